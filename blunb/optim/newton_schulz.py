"""Newton-Schulz orthogonalization engine for Muon: batched, CUDA-graph replayed, SYRK-aware.

The math is torch.optim.Muon's `_zeropower_via_newtonschulz`, batched (same-shape matrices as one bmm
chain in bf16), with the symmetric products on the Triton SYRK where its autotune verdict beat cuBLAS.
Why graphs: one NS call launches ~25 kernels from Python, and that host cost, not the GEMMs, dominates
small matrices; so on CUDA each (batch, rows, cols) slot is captured once as a CUDA graph and replayed
(the same kernels on the same data: results bitwise identical to eager). BLUNB_NS_GRAPHS=0 turns graphs
off.

Details (the iteration for wide and tall X, the coefficient schedules fixed and polar_express, the
capture rules): docs/architecture.md, section "blunb/optim/newton_schulz.py"; the AOL start: _aol_start.
"""

from __future__ import annotations

import logging
import numbers
import os
from dataclasses import dataclass

import torch

log = logging.getLogger(__name__)

# Keller Jordan's quintic, torch.optim.Muon's default: the same (a, b, c) at every iteration.
MUON_COEFFICIENTS = (3.4445, -4.7750, 2.0315)

# Polar Express (Amsel, Persson, Musco, Gower, "The Polar Express: Optimal Matrix Sign Methods and Their
# Application to the Muon Algorithm", arXiv 2505.16932, Algorithm 1: degree 5, lower bound l = 1e-3, the
# version run in bf16 in their GPT-2 experiments). Each triple is the minimax-optimal odd quintic for the
# singular-value interval the previous ones leave, before the safety factor. The last one is the classical
# (15x - 10x^3 + 3x^5) / 8, which the optimal polynomials reach numerically; the paper's rule repeats it
# for every later iteration, so any ns_steps has a schedule.
POLAR_EXPRESS_OPTIMAL = (
    (8.28721201814563, -23.595886519098837, 17.300387312530933),
    (4.107059111542203, -2.9478499167379106, 0.5448431082926601),
    (3.9486908534822946, -2.908902115962949, 0.5518191394370137),
    (3.3184196573706015, -2.488488024314874, 0.51004894012372),
    (2.300652019954817, -1.6689039845747493, 0.4188073119525673),
    (1.891301407787398, -1.2679958271945868, 0.37680408948524835),
    (1.8750014808534479, -1.2500016453999487, 0.3750001645474248),
    (1.875, -1.25, 0.375),
)
# Algorithm 1's bf16 safety factor (its Section 4.4): every polynomial but the last becomes p(x / 1.01), so
# round-off just above the interval's upper bound cannot grow from one iteration to the next, and the input
# is divided by 1.01 ||X||_F + eps rather than ||X||_F.
POLAR_EXPRESS_SAFETY = 1.01
EPS = 1e-7


def _scaled(abc: tuple[float, float, float], s: float) -> tuple[float, float, float]:
    """(a, b, c) of x -> p(x / s) for p(x) = a x + b x^3 + c x^5."""
    a, b, c = abc
    return a / s, b / s**3, c / s**5


@dataclass(frozen=True)
class NSSchedule:
    """A coefficient schedule: (a, b, c) per iteration, its last triple repeated past its length; the
    input is divided by safety * ||X||_F (1.0: torch.optim.Muon's max(||X||_F, eps))."""

    coefficients: tuple[tuple[float, float, float], ...]
    safety: float = 1.0

    def per_step(self, steps: int) -> list[tuple[float, float, float]]:
        extra = max(0, steps - len(self.coefficients))
        return list(self.coefficients[:steps]) + [self.coefficients[-1]] * extra


# The Muon setting muon_ns_schedule (TrainConfig) names one of these; "fixed" is the default.
NS_SCHEDULES = {
    "fixed": NSSchedule((MUON_COEFFICIENTS,)),
    "polar_express": NSSchedule(tuple(_scaled(t, POLAR_EXPRESS_SAFETY) for t in POLAR_EXPRESS_OPTIMAL[:-1])
                                + POLAR_EXPRESS_OPTIMAL[-1:], POLAR_EXPRESS_SAFETY),
}


# How the first iteration's input is scaled (the Muon setting muon_ns_precondition): "none" divides by the
# Frobenius norm only (torch.optim.Muon's start, the default); "aol" then rescales its rows (_aol_start).
PRECONDITIONS = ("none", "aol")


def resolve_coefficients(coefficients, steps: int) -> tuple[list[tuple[float, float, float]], float]:
    """Per-step (a, b, c) list and the normalization safety factor.

    coefficients: a name in NS_SCHEDULES, one (a, b, c) used at every step, or a sequence of
    `steps` triples, one per step (both of these with safety 1.0).
    """
    if steps < 1:
        raise ValueError(f"ns_steps must be >= 1, got {steps}")
    if isinstance(coefficients, str):
        if coefficients not in NS_SCHEDULES:
            raise ValueError(f"unknown Newton-Schulz schedule {coefficients!r}; known: {', '.join(NS_SCHEDULES)}")
        schedule = NS_SCHEDULES[coefficients]
        return schedule.per_step(steps), schedule.safety
    triples = list(coefficients)
    if all(isinstance(v, numbers.Real) for v in triples):  # one (a, b, c) for every step
        triples = [triples] * steps
    if len(triples) != steps or not all(_is_triple(t) for t in triples):
        raise ValueError(f"ns coefficients must be a schedule name ({', '.join(NS_SCHEDULES)}), one (a, b, c) "
                         f"or {steps} (a, b, c) triples, one per step; got {coefficients!r}")
    return [tuple(float(v) for v in t) for t in triples], 1.0


def _is_triple(t) -> bool:
    return isinstance(t, (tuple, list)) and len(t) == 3 and all(isinstance(v, numbers.Real) for v in t)


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

    coefficients: see resolve_coefficients ("fixed": torch.optim.Muon's). `schedule` names it
    ("custom" for explicit triples). precondition: one of PRECONDITIONS ("aol": see _aol_start).
    graphs: None = on for CUDA unless BLUNB_NS_GRAPHS=0.
    syrk: None = per-shape autotune verdict on CUDA (never on CPU), True/False to force.
    """

    def __init__(self, steps: int = 5, coefficients="fixed", eps: float = EPS,
                 graphs: bool | None = None, syrk: bool | None = None, precondition: str = "none"):
        self.steps = steps
        per_step, self.safety = resolve_coefficients(coefficients, steps)
        self.precondition = _checked_precondition(precondition)
        # A tuple: a captured graph has these values baked in as its kernels' scalars, one set per step.
        self.coefficients = tuple(per_step)
        self.schedule = coefficients if isinstance(coefficients, str) else "custom"
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
        if torch.cuda.is_current_stream_capturing():  # inside a captured training step: its kernels join that graph
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
        for i, (a, b, c) in enumerate(self.coefficients):
            Xw = _wide(X)
            A = triton_syrk(Xw) if syrk[0] else torch.bmm(Xw, Xw.mT)
            if i == 0 and self.precondition == "aol":
                X, A = _aol_start(X, A, self.safety, self.eps)
            B = triton_syrk(A, c, b, A) if syrk[1] else torch.baddbmm(A, A, A, beta=b, alpha=c)
            X = torch.baddbmm(X, X, B, beta=a) if tall else torch.baddbmm(X, B, X, beta=a)
        return X


def _aol_start(X: torch.Tensor, A: torch.Tensor, safety: float, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """AOL (Prach & Lampert, "Almost-Orthogonal Layers for Efficient General-Purpose Lipschitz Networks",
    ECCV 2022), the start of Turbo-Muon (Boissin et al., arXiv 2512.04632): (diag(s) Xw, diag(s) A diag(s)) for
    the wide view Xw of X and its Gram A = Xw Xw^T, s_i = 1 / (safety sqrt(sum_j |A_ij|)).

    Why it is a safe start: with d = s safety and A symmetric, x^T D A D x <= sum_ij |A_ij| |d_i x_i| |d_j x_j|
    <= sum_ij |A_ij| (d_i^2 x_i^2 + d_j^2 x_j^2) / 2 = sum_i x_i^2, so ||diag(s) Xw||_2 <= 1 / safety whatever
    the input, as with Frobenius normalization alone; but the small singular values of a gradient-like input
    start ~3x (Gaussian) to ~20x (rows of spread norms) higher, worth about one iteration of the fixed
    quintic (tests/test_ns_schedules.py measures it). The scaled Gram comes from A, so the first iteration
    runs no extra GEMM. Any scale of X cancels in s; X still arrives Frobenius-normalized (Turbo-Muon drops
    that pass), which keeps A within [-1, 1] whatever the gradient's scale (no bf16 under- or overflow) and
    makes the eps clamp act only on rows ~0 relative to ||X||_F (a smaller s than AOL's: still within the
    bound). The iterations after it run the engine's schedule unchanged; Turbo-Muon instead runs the last 4
    of its 5 per-step triples (the first dropped), a retuning not adopted here.
    """
    s = _aol_scales(A, safety, eps)
    X = X * (s.unsqueeze(-2) if X.shape[-2] > X.shape[-1] else s.unsqueeze(-1))  # tall: its columns are Xw's rows
    # s_i s_j == s_j s_i bitwise, so the scaled Gram stays exactly symmetric (the SYRK of A A assumes it)
    return X, A * (s.unsqueeze(-1) * s.unsqueeze(-2))


def _aol_scales(A: torch.Tensor, safety: float, eps: float) -> torch.Tensor:
    """s_i = 1 / (safety sqrt(max(sum_j |A_ij|, eps))) over A's last dim, summed in fp32 at least (one pass over A,
    no |A| temporary), rounded once to A's dtype."""
    row_sums = torch.linalg.vector_norm(A, ord=1, dim=-1, dtype=torch.promote_types(A.dtype, torch.float32))
    return torch.rsqrt(row_sums.clamp(min=eps)).div(safety).to(A.dtype)


def _checked_precondition(precondition: str) -> str:
    if precondition not in PRECONDITIONS:
        raise ValueError(f"unknown Newton-Schulz precondition {precondition!r}; known: {', '.join(PRECONDITIONS)}")
    return precondition


def _wide(X: torch.Tensor) -> torch.Tensor:
    """X in the wide orientation: a transposed view of a tall X (no copy), X itself otherwise."""
    return X.mT if X.shape[-2] > X.shape[-1] else X


def zeropower_reference(G: torch.Tensor, steps: int = 5, coefficients="fixed", eps: float = EPS,
                        precondition: str = "none"):
    """torch.optim.Muon's NS on one matrix, for tests and benchmarks (plain 2-D ops), with any
    coefficients and precondition NewtonSchulz takes."""
    per_step, safety = resolve_coefficients(coefficients, steps)
    _checked_precondition(precondition)
    X = G.bfloat16()
    tall = G.size(0) > G.size(1)
    X = X.T if tall else X
    X = X / X.norm().clamp(min=eps) if safety == 1.0 else X / (X.norm() * safety + eps)
    for i, (a, b, c) in enumerate(per_step):
        A = X @ X.T
        if i == 0 and precondition == "aol":
            s = _aol_scales(A, safety, eps)
            X, A = X * s[:, None], A * (s[:, None] * s[None, :])
        X = torch.addmm(X, torch.addmm(A, A, A, beta=b, alpha=c), X, beta=a)
    return X.T if tall else X
