"""cuda_graph: the steady-state training step captured once as a CUDA graph and replayed.

Why: at small and medium sizes a step is hundreds of kernel launches from Python (every micro-batch's
forward and backward, the clip's norms, the optimizer update), and the host, not the GPU, sets the pace;
a replay launches them all at once. At world size 1, after WARMUP_STEPS eager steps on the side stream
the capture then uses, the whole step is captured on static token buffers, with the learning rate read
from a device tensor, and replayed; its results equal the eager step's bit for bit.

decide() says whether a run captures, a pure function of the config and the device facts; blockers()
lists what stands in the way. StepGraph holds the graph. Details (what is captured and what stays
outside, the lr on the device, checkpoints): docs/architecture.md, section "blunb/cuda_graph.py".
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass

import torch

from blunb.config import ConfigError

log = logging.getLogger(__name__)

# Eager steps before the capture. Two at least: Newton-Schulz decides its SYRK on a shape's first call and
# the compiled backward is built on the first backward; the third is slack for anything lazy after that.
WARMUP_STEPS = 3
# The optimizer sets whose update can be captured (blunb.optim.build.ZeroOptimizers.keep_lr_on_device).
CAPTURABLE_OPTIMIZERS = ("adamw", "muon")


@dataclass(frozen=True)
class GraphDecision:
    on: bool
    why: str

    def facts(self, setting) -> dict:
        """What env.json records: the setting, what was picked and why."""
        return {"setting": setting, "on": self.on, "why": self.why, "warmup_steps": WARMUP_STEPS if self.on else None}


def blockers(cfg, device_type: str | None, world_size: int) -> list[str]:
    """Why the training step cannot be captured for this config on this device (device_type "cuda" | "cpu", or
    None when it is not known yet); empty when it can."""
    from blunb.kernels import parse_backends

    out = []
    if device_type == "cpu":
        out.append("the device is the CPU; CUDA graphs need CUDA")
    if world_size > 1:
        out.append(f"world size {world_size}: the ZeRO collectives wait on NCCL work handles from Python and are not "
                   "captured; only world size 1 is")
    if cfg.optimizer not in CAPTURABLE_OPTIMIZERS:
        out.append(f"optimizer={cfg.optimizer} keeps its learning rate on the host (a replay would repeat the "
                   f"captured one); supported: {', '.join(CAPTURABLE_OPTIMIZERS)}")
    if parse_backends(cfg.kernels)["adamw"] == "torch":
        out.append("kernels adamw=torch: torch._fused_adamw_ takes the learning rate from the host; the captured "
                   "step needs the fused shard update, which reads it on the device")
    if cfg.diag:
        out.append("diag=true reads the replicas back to the host every step")
    if cfg.fault_nan_grad:
        out.append("fault_nan_grad poisons one step's gradient from the host")
    if cfg.model.fp8 != "off":
        out.append(f"model.fp8={cfg.model.fp8}: torchao's float8 Linears are not verified under capture")
    return out


def check(cfg, device_type: str | None, world_size: int) -> None:
    """cuda_graph=true where the step cannot be captured: a ConfigError naming why, before any work."""
    if cfg.cuda_graph is True:
        reasons = blockers(cfg, device_type, world_size)
        if reasons:
            raise ConfigError(f"cuda_graph=true cannot capture this run's step: {'; '.join(reasons)}. "
                              "Set cuda_graph=false (or auto: on where it is supported)")


def decide(cfg, device_type: str, world_size: int) -> GraphDecision:
    """Whether the run captures its step (cfg.cuda_graph true | false | auto), and why: a pure function of the
    config and the device facts. true where it cannot be is check()'s ConfigError."""
    if cfg.cuda_graph is False:
        return GraphDecision(False, "cuda_graph=false")
    check(cfg, device_type, world_size)
    reasons = blockers(cfg, device_type, world_size)
    if reasons:
        return GraphDecision(False, "auto: " + "; ".join(reasons))
    how = (f"world size 1, optimizer={cfg.optimizer}: forward, backward, clip and update captured after "
           f"{WARMUP_STEPS} eager steps, then replayed")
    return GraphDecision(True, ("auto: CUDA, " if cfg.cuda_graph == "auto" else "cuda_graph=true: ") + how)


class StepGraph:
    """The training step as one torch.cuda.CUDAGraph.

    The loop runs `with graph.warmup(): <its eager step>` until capture_due(), then, each step: load() every
    micro-batch into the static inputs, capture(body) once (body(inputs) queues the step on the static inputs
    and returns its outputs, kept as the graph's static outputs), then replay(), which returns those outputs
    holding this step's values.
    """

    def __init__(self, device: torch.device, warmup_steps: int = WARMUP_STEPS):
        self.device = device
        self.stream = torch.cuda.Stream(device)   # the warm-up steps' and the capture's
        self.warmup_left = warmup_steps
        self.inputs: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.graph: torch.cuda.CUDAGraph | None = None
        self.outputs = None
        # The capture's peak allocation (bytes): the step's activations live in the graph's private pool, which a
        # replay reuses without allocating, so a replayed step's own peak would leave them out.
        self.capture_peak = 0

    @property
    def captured(self) -> bool:
        return self.graph is not None

    def capture_due(self) -> bool:
        return self.graph is None and self.warmup_left <= 0

    @contextlib.contextmanager
    def warmup(self):
        """An eager step before the capture, on the stream the capture will use."""
        current = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(current)
        try:
            with torch.cuda.stream(self.stream):
                yield
        finally:
            current.wait_stream(self.stream)
            self.warmup_left -= 1

    def load(self, micro: int, x: torch.Tensor, y: torch.Tensor) -> None:
        """Copy micro-batch `micro`'s tokens into its static input buffers (made on the first load); queued after
        the previous replay, which read them."""
        if micro == len(self.inputs):
            self.inputs.append((torch.empty_like(x, device=self.device), torch.empty_like(y, device=self.device)))
        sx, sy = self.inputs[micro]
        sx.copy_(x, non_blocking=True)
        sy.copy_(y, non_blocking=True)

    def capture(self, body) -> None:
        graph = torch.cuda.CUDAGraph()
        # thread_local: another thread's CUDA calls (a loader's pinned copy) must not invalidate the capture;
        # autograd's backward thread queues its kernels on the capturing stream, so they are captured
        with torch.cuda.graph(graph, stream=self.stream, capture_error_mode="thread_local"):
            self.outputs = body(self.inputs)
        self.graph = graph
        self.capture_peak = torch.cuda.max_memory_allocated(self.device)

    def replay(self):
        self.graph.replay()
        return self.outputs
