"""The reference trainer's diagnostics (diag=true): what to read when a step spikes.

Per step, from ONE batched device -> host read (and, at W > 1, one all_gather): [micro] every rank's
micro-batch losses and their outliers, named by shard and offset (the step's loss averages a bad
micro-batch away; its gradient does not); [depth] gradient and weight magnitudes at a few layers (where a
blow-up starts says whether it is the forward or the update); [replica] a hash of every parameter's bits
compared across ranks (ZeRO replicas must be bit-identical). One read per step, and no host sync before
end_step, keeps it cheap enough to leave on. Construct it BEFORE the optimizers, so its gradient hook
runs before any hook that reduces gradients in place during backward.

Details (the items, the wiring, when the weights are read, diag.csv's rows, the cost):
docs/architecture.md, section "blunb/diag.py".
"""

from __future__ import annotations

import csv
import functools
import weakref
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn

from blunb.optim import collectives

CSV_COLUMNS = ("step", "item", "rank", "micro", "value", "detail")
OUTLIER_MARGIN = 0.5       # the seed's: a micro-batch above median + 0.5 is an outlier
_NAME_BYTES = 64           # shard names ride the int64 gather as fixed-width bytes (the last 64)
_NAME_WORDS = _NAME_BYTES // 8
_CHUNK = 1 << 22           # checksum block: each int64 temporary is 32 MiB
_INT_OF_SIZE = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_BLOCK_MIX = 0x9E3779B97F4A7C15 - 2**64   # the golden-ratio multiplier, as a signed int64
_EVEN_63 = 2**63 - 2                      # keep 63 bits, clear bit 0: an even offset


def probe_layers(n_layers: int, count: int = 5) -> list[int]:
    """`count` (>= 2) evenly spaced layer indices, first and last included, fewer when the
    model is shallower (36 layers: 0 8 17 26 35, the seed's)."""
    return sorted({i * (n_layers - 1) // (count - 1) for i in range(count)})


@functools.lru_cache(maxsize=4)
def _position_weights(n: int, device: torch.device) -> torch.Tensor:
    """n pseudo-random ODD int64 weights, from a fixed seed (identical on every rank). Odd, so
    changing one element's bits by d != 0 changes the sum by d * w != 0 (mod 2^64): a one-ulp
    change is always caught. A swap changes it by (b_i - b_j)(w_j - w_i): zero only by collision."""
    gen = torch.Generator().manual_seed(0x5EED)
    return (torch.randint(-2**62, 2**62, (n,), dtype=torch.int64, generator=gen) | 1).to(device)


@torch.no_grad()
def replica_checksum(params, chunk: int = _CHUNK) -> torch.Tensor:
    """Position-weighted int64 hash of the raw bits of `params`, in order, as one sequence.

    A 0-dim int64 tensor on the parameters' device (no host sync); wrapping integer
    arithmetic, so it is exact and the same on every rank for the same bits. Equal iff the
    bits are equal, barring collisions: a one-ulp change always changes it, a permutation
    almost surely. Works block by block (`chunk` elements), so temporaries stay bounded;
    element i of block k weighs weights[i] + an even offset of k: still odd, and different
    from position i of every other block (a swap across blocks shows too).
    """
    params = list(params)
    device = params[0].device
    weights = _position_weights(chunk, device)
    buf = torch.empty(chunk, dtype=torch.int64, device=device)
    weighted, plain = [], []     # per block: sum(bits * weights), sum(bits)

    def fold(n: int) -> None:
        weighted.append((buf[:n] * weights[:n]).sum())
        plain.append(buf[:n].sum())

    fill = 0
    for p in params:
        bits = p.detach().reshape(-1).view(_INT_OF_SIZE[p.element_size()])
        a = 0
        while a < bits.numel():
            take = min(chunk - fill, bits.numel() - a)
            buf[fill: fill + take].copy_(bits[a: a + take])    # sign-extends to int64
            fill, a = fill + take, a + take
            if fill == chunk:
                fold(chunk)
                fill = 0
    if fill:
        fold(fill)
    if not weighted:
        return torch.zeros((), dtype=torch.int64, device=device)
    # The block offsets are combined once at the end: three kernels per block, not six.
    offsets = (torch.arange(len(plain), device=device) * _BLOCK_MIX) & _EVEN_63
    return torch.stack(weighted).sum() + (torch.stack(plain) * offsets).sum()


def _grad_norm_hook(diag_ref, k: int):
    """Post-accumulate-grad hook of probe k: the norm of the gradient accumulated so far. It
    fires once per micro-batch; the last one (the full local gradient) is what end_step reads.
    Holds the Diagnostics weakly: an unclosed, dropped one costs nothing."""
    def hook(p: torch.Tensor) -> None:
        diag = diag_ref()
        if diag is not None:
            diag._grad_norm[k] = torch.linalg.vector_norm(p.grad.detach(), dtype=torch.float32)
    return hook


def _hex(v) -> str:
    return f"0x{int(v) & (2**64 - 1):016x}"


@dataclass
class StepReport:
    """One step's diagnostics, decoded on the host; identical on every rank."""

    step: int
    probe_layers: list[int]
    losses: np.ndarray              # [W, M] micro-batch losses
    shards: list[list[list[str]]]   # [W][M][R] shard file name of each row
    offsets: np.ndarray             # [W, M, R] token offset of each row
    grad_norms: np.ndarray          # [W, P] pre-reduce local ||grad(wQ)|| (nan: no gradient this step)
    max_abs_q_gamma: np.ndarray     # [P] rank 0's
    max_abs_wq: np.ndarray          # [P] rank 0's
    checksums: np.ndarray           # [W] replica_checksum of every rank

    @property
    def median(self) -> float:
        """The seed's median: sorted[n // 2] (the upper middle for an even count)."""
        return float(np.sort(self.losses, axis=None)[self.losses.size // 2])

    @property
    def outliers(self) -> list[tuple[int, int]]:
        """(rank, micro) of every micro-batch above median + OUTLIER_MARGIN."""
        return [(int(r), int(m)) for r, m in zip(*np.nonzero(self.losses > self.median + OUTLIER_MARGIN))]

    @property
    def mismatched_ranks(self) -> list[int]:
        """Ranks whose parameter checksum differs from rank 0's."""
        return [r for r, c in enumerate(self.checksums) if c != self.checksums[0]]

    def where(self, r: int, m: int) -> str:
        """Rank r's micro-batch m as `shard:offset` per row, space-separated."""
        return " ".join(f"{s}:{o}" for s, o in zip(self.shards[r][m], self.offsets[r, m]))

    def lines(self) -> list[str]:
        """The seed's [micro] / [depth] lines and a [replica] line (an ERROR line on a mismatch)."""
        W, M = self.losses.shape
        med, hot = self.median, set(self.outliers)
        per_rank = [" ".join(f"{'*' if (r, m) in hot else ''}{self.losses[r, m]:.3f}" for m in range(M))
                    for r in range(W)]
        out = [f"  [micro] med {med:.4f} | "
               + (per_rank[0] if W == 1 else " | ".join(f"r{r} {txt}" for r, txt in enumerate(per_rank)))]
        out += [f"  [micro] OUTLIER rank {r} m={m} loss {self.losses[r, m]:.4f} (median {med:.4f}) from "
                f"{self.where(r, m)} (shard:token offset per row)" for r, m in self.outliers]

        def by_layer(values, fmt):
            return "".join(f" L{layer} {v:{fmt}}" for layer, v in zip(self.probe_layers, values))
        out.append(f"  [depth] ||g(wQ)|| by layer (rank 0, pre-reduce):{by_layer(self.grad_norms[0], '.3e')}"
                   f" | max|q_gamma|:{by_layer(self.max_abs_q_gamma, '.4f')}"
                   f" | max|wQ|:{by_layer(self.max_abs_wq, '.4f')}")
        bad = self.mismatched_ranks
        if bad:
            out.append(f"  [replica] ERROR step {self.step}: the parameter checksum of rank(s) "
                       f"{', '.join(map(str, bad))} differs from rank 0's ({self._checksum_text()})")
        else:
            out.append(f"  [replica] {W} rank(s) bit-identical (checksum {_hex(self.checksums[0])})")
        return out

    def csv_rows(self) -> list[tuple]:
        """diag.csv rows (CSV_COLUMNS; the module docstring lists the items)."""
        W, M = self.losses.shape
        s = self.step
        rows = [(s, "micro_loss", r, m, float(self.losses[r, m]), self.where(r, m)) for r in range(W) for m in range(M)]
        rows.append((s, "micro_median", "", "", self.median, ""))
        rows += [(s, "micro_outlier", r, m, float(self.losses[r, m]), self.where(r, m)) for r, m in self.outliers]
        for k, layer in enumerate(self.probe_layers):
            rows += [(s, f"probe_grad_norm.L{layer}", r, "", float(self.grad_norms[r, k]), "") for r in range(W)]
            rows.append((s, f"probe_max_abs_q_gamma.L{layer}", 0, "", float(self.max_abs_q_gamma[k]), ""))
            rows.append((s, f"probe_max_abs_wq.L{layer}", 0, "", float(self.max_abs_wq[k]), ""))
        rows.append((s, "replica_checksum_match", "", "", int(not self.mismatched_ranks), self._checksum_text()))
        return rows

    def _checksum_text(self) -> str:
        return " ".join(f"r{r}={_hex(c)}" for r, c in enumerate(self.checksums))


class Diagnostics:
    """Per-step [micro] / [depth] / [replica] diagnostics of a BLU model (module docstring).

    Every rank constructs one (before the optimizers) and calls record_micro and end_step at
    the same points with the same number of micro-batches; end_step is a collective at W > 1.
    `run_dir`: where rank 0 appends diag.csv (None: no file). Lines come back from end_step,
    identical on every rank, and `last` holds the decoded values; the caller prints the lines
    (rank 0) and decides what a mismatch means (`last.mismatched_ranks`, the same on every rank).
    """

    def __init__(self, model: nn.Module, rank: int = 0, world_size: int = 1,
                 run_dir: str | Path | None = None, *, n_probes: int = 5):
        self.world_size = world_size
        self.params = list(model.parameters())
        self.device = self.params[0].device
        self.probe_layers = probe_layers(len(model.blocks), n_probes)
        attn = [model.blocks[layer].attn for layer in self.probe_layers]
        self._wq = [a.wq.weight for a in attn]
        self._q_gamma = [a.q_gamma for a in attn]
        self._grad_norm: list[torch.Tensor | None] = [None] * len(attn)
        self._hooks = [w.register_post_accumulate_grad_hook(_grad_norm_hook(weakref.ref(self), k))
                       for k, w in enumerate(self._wq)]
        self._losses: list[torch.Tensor] = []
        self._where: list[list[tuple[str, int]]] = []
        self._weights: tuple[torch.Tensor, torch.Tensor] | None = None
        self.last: StepReport | None = None       # the latest end_step's values
        self.rank = rank
        self._file = self._csv = None
        if run_dir is not None:
            self.open_csv(run_dir)

    def open_csv(self, run_dir: str | Path) -> None:
        """Append every later step's rows to <run_dir>/diag.csv (rank 0; the folder must exist).
        Separate from construction, which must precede the optimizers, while the run folder
        may only be claimed once everything is built."""
        if self.rank != 0:
            return
        path = Path(run_dir) / "diag.csv"
        new = not path.exists() or path.stat().st_size == 0
        self._file = open(path, "a", newline="")
        self._csv = csv.writer(self._file)
        if new:
            self._csv.writerow(CSV_COLUMNS)

    def record_micro(self, loss: torch.Tensor, rows) -> None:
        """One micro-batch: its loss (kept on the device, no sync) and where it came from: the
        (shard, offset) of each of its rows, the loader's where() before its next_batch (every
        micro-batch of every rank has as many). The step's first call also reads the weights."""
        if not self._losses:
            amax = torch.stack([t.detach().abs().amax().float() for t in self._q_gamma + self._wq])
            self._weights = (replica_checksum(self.params), amax)
        self._losses.append(loss.detach().reshape(()).float())
        self._where.append([(shard, int(offset)) for shard, offset in rows])

    def end_step(self, step: int) -> list[str]:
        """After the optimizer step: gather the step's values from every rank, append its rows
        to diag.csv (rank 0) and return the [micro] / [depth] / [replica] lines."""
        if not self._losses:
            raise RuntimeError(f"Diagnostics.end_step({step}): record_micro was not called this step")
        M, P, W = len(self._losses), len(self.probe_layers), self.world_size
        checksum, amax = self._weights
        nan = torch.full((), float("nan"), device=self.device)
        gnorm = torch.stack([nan if g is None else g for g in self._grad_norm])
        floats = torch.cat([gnorm, amax, torch.stack(self._losses)]).double()
        R = len(self._where[0])
        if any(len(rows) != R for rows in self._where):  # the gather's layout needs one R for all
            raise RuntimeError(f"Diagnostics.end_step({step}): the micro-batches name "
                               f"{sorted({len(w) for w in self._where})} rows; each must name as many")
        where = np.zeros((M, R, 1 + _NAME_WORDS), dtype=np.int64)
        for m, rows in enumerate(self._where):
            for k, (shard, offset) in enumerate(rows):
                where[m, k, 0] = offset
                where[m, k, 1:] = np.frombuffer(shard.encode()[-_NAME_BYTES:].ljust(_NAME_BYTES, b"\0"),
                                                dtype=np.int64)
        # One int64 row per rank: checksum | floats' bits | offsets and names.
        mine = torch.cat([checksum.reshape(1), floats.view(torch.int64),
                          torch.from_numpy(where.reshape(-1)).to(self.device)])
        if W > 1:
            gathered = torch.empty(W * mine.numel(), dtype=torch.int64, device=self.device)
            collectives.all_gather(gathered, mine)
        else:
            gathered = mine
        table = gathered.view(W, -1).cpu().numpy()     # the step's one device -> host read
        self._losses, self._where, self._weights = [], [], None
        self._grad_norm = [None] * P

        values = table[:, 1: 1 + 3 * P + M].view(np.float64)
        meta = table[:, 1 + 3 * P + M:].reshape(W, M, R, 1 + _NAME_WORDS)
        self.last = StepReport(
            step=step, probe_layers=self.probe_layers, losses=values[:, 3 * P:],
            shards=[[[meta[r, m, k, 1:].tobytes().rstrip(b"\0").decode(errors="replace") for k in range(R)]
                     for m in range(M)] for r in range(W)],
            offsets=meta[:, :, :, 0], grad_norms=values[:, :P], max_abs_q_gamma=values[0, P: 2 * P],
            max_abs_wq=values[0, 2 * P: 3 * P], checksums=table[:, 0])
        if self._csv is not None:
            self._csv.writerows(self.last.csv_rows())
            self._file.flush()
        return self.last.lines()

    def close(self) -> None:
        """Remove the gradient hooks and close diag.csv (idempotent)."""
        for h in self._hooks:
            h.remove()
        self._hooks = []
        if self._file is not None:
            self._file.close()
            self._file = self._csv = None
