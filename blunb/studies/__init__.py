"""The study notebooks' own instruments, apart from the engine: clip_audit (10_clipping), precision
(11_precision) and overlap (12_overlap, the communication model over the optimizers' layouts). Each reads
run folders and configs, or models what the engine plans (blunb.optim.layout); the engine imports none."""
