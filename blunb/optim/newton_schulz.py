"""Newton-Schulz orthogonalization engine for Muon: batched, CUDA-graph replayed, SYRK-aware.

The math is torch.optim.Muon's `_zeropower_via_newtonschulz`, batched (same-shape matrices as one bmm
chain in bf16), with the symmetric products on the Triton SYRK where its autotune verdict beat cuBLAS.
Why graphs: one NS call launches ~25 kernels from Python, and that host cost, not the GEMMs, dominates
small matrices; so on CUDA each (batch, rows, cols) slot is captured once as a CUDA graph and replayed
(the same kernels on the same data: results bitwise identical to eager). BLUNB_NS_GRAPHS=0 turns graphs
off.

Details (the iteration for wide and tall X, polar_express, the capture rules): docs/architecture.md,
section "blunb/optim/newton_schulz.py".
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch

log = logging.getLogger(__name__)

MUON_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
POLAR_EXPRESS_COEFFICIENTS = (
    (8.156554524902461, -22.48329292557795, 15.878769915207462),
    (4.042929935166739, -2.808917465908714, 0.5000178451051316),
    (3.8916678022926607, -2.772484153217685, 0.5060648178503393),
    (3.285753657755655, -2.3681294933425376, 0.46449024233003106),
    (2.3465413258596377, -1.7097828382687081, 0.42323551169305323),
)
POLAR_EXPRESS_SAFETY = 1.02
EPS = 1e-7


def resolve_coefficients(coefficients, steps: int) -> tuple[list[tuple[float, float, float]], float]:
    """Per-step (a, b, c) list and the normalization safety factor.

    coefficients: "muon" (torch.optim.Muon's), "polar_express" (its 5-step schedule;
    extra steps repeat the last), or one (a, b, c) tuple used at every step.
    """
    if steps < 1:
        raise ValueError(f"ns_steps must be >= 1, got {steps}")
    if coefficients == "muon":
        return [MUON_COEFFICIENTS] * steps, 1.0
    if coefficients == "polar_express":
        pe = list(POLAR_EXPRESS_COEFFICIENTS)
        return (pe + [pe[-1]] * steps)[:steps], POLAR_EXPRESS_SAFETY
    abc = tuple(float(v) for v in coefficients)
    if len(abc) != 3:
        raise ValueError(f"ns coefficients must be 'muon', 'polar_express' or (a, b, c), got {coefficients!r}")
    return [abc] * steps, 1.0


def graphs_enabled() -> bool:
    return os.environ.get("BLUNB_NS_GRAPHS", "1") != "0"


@dataclass
class _Slot:
    stage: torch.Tensor                  # persistent bf16 input [b, rows, cols]
    calls: int = 0
    graph: torch.cuda.CUDAGraph | None = None
    out: torch.Tensor | None = None      # the graph's static output
    eager_only: bool = False             # capture failed (or graphs off): always eager
    syrk: tuple[bool, bool] = (False, False)  # Triton SYRK for (Gram, A A), decided on the first call


class NewtonSchulz:
    """Orthogonalizes batches of matrices; one instance per optimizer (it owns the graphs).

    Typical use (what ShardedMuon does): `buf = ns.stage(b, m, n, device)`, write the
    b inputs into buf (any float dtype casts to bf16 on the copy), `out = ns.run(buf)`.
    Or simply `out = ns(G)` for G [m, n] or [b, m, n]. Either orientation runs as given
    (see the module docstring). The result is bf16 [b, m, n] and, on CUDA, is the graph's
    static buffer: it stays valid until the next call for the same shape, so consume (or
    clone) it before that; the caller may modify it in place.

    graphs: None = on for CUDA unless BLUNB_NS_GRAPHS=0. syrk: None = per-shape autotune
    verdict on CUDA (never on CPU), True/False to force.
    """

    def __init__(self, steps: int = 5, coefficients="muon", eps: float = EPS,
                 graphs: bool | None = None, syrk: bool | None = None):
        self.steps = steps
        self.coefficients, self.safety = resolve_coefficients(coefficients, steps)
        self.eps = eps
        self.graphs = graphs_enabled() if graphs is None else graphs
        self.syrk = syrk
        self._slots: dict[tuple, _Slot] = {}

    # -- staging ---------------------------------------------------------------------
    def stage(self, b: int, rows: int, cols: int, device) -> torch.Tensor:
        """The persistent bf16 input buffer [b, rows, cols] of that slot."""
        key = (b, rows, cols, torch.device(device))
        slot = self._slots.get(key)
        if slot is None:
            slot = self._slots[key] = _Slot(torch.empty(b, rows, cols, dtype=torch.bfloat16, device=device))
        return slot.stage

    def __call__(self, G: torch.Tensor) -> torch.Tensor:
        squeeze = G.dim() == 2
        G3 = G.unsqueeze(0) if squeeze else G
        buf = self.stage(G3.shape[0], G3.shape[1], G3.shape[2], G.device)
        buf.copy_(G3)
        out = self.run(buf)
        return out[0] if squeeze else out

    # -- execution -------------------------------------------------------------------
    def run(self, stage: torch.Tensor) -> torch.Tensor:
        """NS on a buffer returned by `stage` -> bf16 [b, rows, cols]."""
        slot = self._slots[(*stage.shape, stage.device)]
        slot.calls += 1
        if slot.calls == 1:
            slot.syrk = self._choose_syrk(stage)  # autotunes here, eagerly, never under capture
        if not (self.graphs and stage.is_cuda) or slot.eager_only or slot.calls == 1:
            return self._ns(stage, slot.syrk)
        if slot.graph is None:
            self._capture(slot)
            if slot.graph is None:
                return self._ns(stage, slot.syrk)
        slot.graph.replay()
        return slot.out

    def _capture(self, slot: _Slot) -> None:
        graph = torch.cuda.CUDAGraph()
        try:
            # thread_local: CUDA calls from other threads (the NCCL watchdog) must not
            # invalidate the capture
            with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                out = self._ns(slot.stage, slot.syrk)
        except Exception as exc:  # e.g. an op that is not capturable in this build
            slot.eager_only = True
            torch.cuda.synchronize()
            log.warning(f"[newton_schulz] CUDA-graph capture FAILED for shape {tuple(slot.stage.shape)}: "
                        f"{type(exc).__name__}: {exc}; this shape runs eagerly from now on")
            return
        slot.graph, slot.out = graph, out

    def _choose_syrk(self, stage: torch.Tensor) -> tuple[bool, bool]:
        if not stage.is_cuda or self.syrk is False:
            return False, False
        if self.syrk:
            return True, True
        from blunb.kernels.fused import syrk as fused_syrk  # triton, only on this CUDA path

        wide = _wide(stage)  # the verdict is for the layout _ns passes: column-major for a tall slot
        n = wide.shape[1]
        square = torch.empty(stage.shape[0], n, n, dtype=stage.dtype, device=stage.device)
        return fused_syrk.use_triton(wide, has_c=False), fused_syrk.use_triton(square, has_c=True)

    def _ns(self, X: torch.Tensor, syrk: tuple[bool, bool]) -> torch.Tensor:
        if syrk[0] or syrk[1]:
            from blunb.kernels.fused.syrk import triton_syrk  # triton, only when a SYRK kernel is chosen
        norm = torch.linalg.vector_norm(X, dim=(-2, -1), keepdim=True)
        if self.safety == 1.0:
            X = X / norm.clamp(min=self.eps)   # torch.optim.Muon's normalization
        else:
            X = X / (norm * self.safety + self.eps)
        tall = X.shape[-2] > X.shape[-1]
        for a, b, c in self.coefficients:
            Xw = _wide(X)
            A = triton_syrk(Xw) if syrk[0] else torch.bmm(Xw, Xw.mT)
            B = triton_syrk(A, c, b, A) if syrk[1] else torch.baddbmm(A, A, A, beta=b, alpha=c)
            X = torch.baddbmm(X, X, B, beta=a) if tall else torch.baddbmm(X, B, X, beta=a)
        return X


def _wide(X: torch.Tensor) -> torch.Tensor:
    """X in the wide orientation: a transposed view of a tall X (no copy), X itself otherwise."""
    return X.mT if X.shape[-2] > X.shape[-1] else X


def zeropower_reference(G: torch.Tensor, steps: int = 5, coefficients=MUON_COEFFICIENTS, eps: float = EPS):
    """torch.optim.Muon's NS on one matrix, for tests and benchmarks (plain 2-D ops)."""
    a, b, c = coefficients
    X = G.bfloat16()
    tall = G.size(0) > G.size(1)
    X = X.T if tall else X
    X = X / X.norm().clamp(min=eps)
    for _ in range(steps):
        A = X @ X.T
        X = torch.addmm(X, torch.addmm(A, A, A, beta=b, alpha=c), X, beta=a)
    return X.T if tall else X
