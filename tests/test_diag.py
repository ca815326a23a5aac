"""blunb.diag: the seed's [micro] / [depth] / [replica] diagnostics.

Single-process on the tiny BLU with plain torch AdamW (values checked against ones computed
here), the replica checksum's sensitivity, and real gloo torchrun launches at W = 2 and 3
(tests/workers/diag_worker.py, one launch each).
"""

import csv
import dataclasses
import math

import pytest
import torch
import torch.nn as nn

from blunb.config import preset
from blunb.diag import CSV_COLUMNS, Diagnostics, probe_layers, replica_checksum
from blunb.model import BLU
from tests.distributed import REPO, torchrun

WORKER = REPO / "tests" / "workers" / "diag_worker.py"
ACCUM = 4
OUTLIER = (1, 2)                    # (step, micro) whose recorded loss gets +2
LONG_SHARD = "x" * 30 + "_a_very_long_shard_file_name_that_does_not_fit_in_64_bytes.bin"


def batch(step, micro, vocab):
    g = torch.Generator().manual_seed(100 * step + micro)
    t = torch.randint(0, vocab, (2, 33), generator=g)
    return t[:, :-1], t[:, 1:]


def where(step, micro):
    """The (shard, offset) of each of a micro-batch's two rows (as the window loader's where() names them)."""
    return [(LONG_SHARD if step == 2 else f"train_{step:03d}.bin", 1000 * step + 64 * micro),
            (f"train_{micro:03d}.bin", 7 * step + micro)]


def detail(rows):
    return " ".join("%s:%d" % (shard[-64:], offset) for shard, offset in rows)


def read_rows(path):
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        assert tuple(reader.fieldnames) == CSV_COLUMNS
        return list(reader)


def test_probe_layers_are_evenly_spaced_with_first_and_last():
    assert probe_layers(36) == [0, 8, 17, 26, 35]       # the seed's
    assert probe_layers(9) == [0, 2, 4, 6, 8]
    assert probe_layers(4) == [0, 1, 2, 3]
    assert probe_layers(1) == [0]
    cfg = dataclasses.replace(preset("tiny").model, n_layers=9, d_model=32, head_dim=16, q_heads=2, kv_heads=1,
                              ffn_hidden=64)
    assert Diagnostics(BLU(cfg)).probe_layers == [0, 2, 4, 6, 8]


def test_single_process_micro_losses_probes_and_csv(tmp_path):
    model = BLU(preset("tiny").model, seed=0)
    diag = Diagnostics(model, 0, 1, tmp_path)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    layers = diag.probe_layers
    assert layers == [0, 1, 2, 3]
    wq = [model.blocks[k].attn.wq.weight for k in layers]
    q_gamma = [model.blocks[k].attn.q_gamma for k in layers]
    steps, expected = 3, []
    for step in range(steps):
        opt.zero_grad(set_to_none=True)
        wq_max = [w.abs().max().item() for w in wq]          # the weights this step trains with
        qg_max = [g.abs().max().item() for g in q_gamma]
        losses = []
        for micro in range(ACCUM):
            _, loss = model(*batch(step, micro, model.cfg.vocab_size))
            (loss / ACCUM).backward()
            if (step, micro) == OUTLIER:
                loss = loss + 2.0
            losses.append(loss.item())
            diag.record_micro(loss, where(step, micro))
        grad_norms = [torch.linalg.vector_norm(w.grad).item() for w in wq]
        opt.step()
        lines = diag.end_step(step)
        rep = diag.last

        median = sorted(losses)[ACCUM // 2]                   # the seed's median: sorted[n / 2]
        assert rep.losses[0].tolist() == losses and rep.median == median
        assert lines[0] == f"  [micro] med {median:.4f} | " + " ".join(
            f"{'*' if (step, m) == OUTLIER else ''}{v:.3f}" for m, v in enumerate(losses))
        outlier_lines = [ln for ln in lines if "OUTLIER" in ln]
        if step == OUTLIER[0]:
            m = OUTLIER[1]
            assert rep.outliers == [(0, m)]
            assert outlier_lines == [f"  [micro] OUTLIER rank 0 m={m} loss {losses[m]:.4f} (median {median:.4f}) "
                                     f"from train_001.bin:{1000 + 64 * m} train_{m:03d}.bin:{7 + m} (shard:token "
                                     "offset per row)"]
        else:
            assert rep.outliers == [] and outlier_lines == []
        assert rep.grad_norms[0].tolist() == grad_norms
        assert rep.max_abs_wq.tolist() == wq_max and rep.max_abs_q_gamma.tolist() == qg_max
        assert rep.mismatched_ranks == [] and lines[-1].startswith("  [replica] 1 rank(s) bit-identical")
        assert lines[-2].startswith("  [depth] ||g(wQ)|| by layer (rank 0, pre-reduce): L0 ")
        expected.append((losses, grad_norms, wq_max, qg_max))
    # a long (ASCII) name keeps its last 64 bytes
    assert diag.last.shards[0] == [[LONG_SHARD[-64:], f"train_{m:03d}.bin"] for m in range(ACCUM)]
    assert diag.last.offsets[0].tolist() == [[2000 + 64 * m, 14 + m] for m in range(ACCUM)]
    diag.close()

    rows = read_rows(tmp_path / "diag.csv")
    P = len(layers)
    for step, (losses, grad_norms, wq_max, qg_max) in enumerate(expected):
        mine = [r for r in rows if int(r["step"]) == step]
        n_out = int(step == OUTLIER[0])
        assert len(mine) == ACCUM + 1 + n_out + P * 3 + 1        # W*M + median + outliers + P*(W+2) + match
        by_item = {}
        for r in mine:
            by_item.setdefault(r["item"], []).append(r)
        micro = by_item["micro_loss"]
        assert [(r["rank"], int(r["micro"]), float(r["value"]), r["detail"]) for r in micro] == \
            [("0", m, losses[m], detail(where(step, m))) for m in range(ACCUM)]
        assert float(by_item["micro_median"][0]["value"]) == sorted(losses)[ACCUM // 2]
        outl = by_item.get("micro_outlier", [])
        assert [(int(r["micro"]), r["detail"]) for r in outl] == \
            ([(OUTLIER[1], detail(where(*OUTLIER)))] if n_out else [])
        for k, layer in enumerate(layers):
            assert [float(r["value"]) for r in by_item[f"probe_grad_norm.L{layer}"]] == [grad_norms[k]]
            assert float(by_item[f"probe_max_abs_wq.L{layer}"][0]["value"]) == wq_max[k]
            assert float(by_item[f"probe_max_abs_q_gamma.L{layer}"][0]["value"]) == qg_max[k]
        match = by_item["replica_checksum_match"]
        assert len(match) == 1 and match[0]["value"] == "1" and match[0]["detail"].startswith("r0=0x")


def test_missing_gradient_reads_nan_and_close_removes_the_hooks():
    model = BLU(preset("tiny").model, seed=0)
    diag = Diagnostics(model)
    with torch.no_grad():
        _, loss = model(*batch(0, 0, model.cfg.vocab_size))
    diag.record_micro(loss, [("s.bin", 0)])
    diag.end_step(0)
    assert all(math.isnan(v) for v in diag.last.grad_norms[0])
    with pytest.raises(RuntimeError, match="record_micro was not called"):
        diag.end_step(1)
    diag.close()
    _, loss = model(*batch(0, 0, model.cfg.vocab_size))
    loss.backward()
    diag.record_micro(loss.detach(), [("s.bin", 0)])
    diag.end_step(2)
    assert all(math.isnan(v) for v in diag.last.grad_norms[0])   # closed: the hooks no longer fire


def test_checksum_sees_a_swap_and_one_ulp_and_equals_an_identical_copy():
    model, copy = BLU(preset("tiny").model, seed=0), BLU(preset("tiny").model, seed=0)
    base = replica_checksum(model.parameters())
    assert base.dtype == torch.int64 and base.dim() == 0
    assert torch.equal(replica_checksum(copy.parameters()), base)

    def changed(edit, params=copy.parameters, **kw):
        """Does `edit` (applied in place, then undone) change the checksum?"""
        ref = replica_checksum(params(), **kw)
        saved = [p.detach().clone() for p in params()]
        with torch.no_grad():
            edit()
        after = replica_checksum(params(), **kw)
        with torch.no_grad():
            for p, s in zip(params(), saved):
                p.copy_(s)
        assert torch.equal(replica_checksum(params(), **kw), ref)
        return not torch.equal(after, ref)

    def swap(t, i, j):
        t[[i, j]] = t[[j, i]].clone()

    def ulp(t, i, direction=math.inf):
        t[i] = torch.nextafter(t[i], torch.tensor(direction, dtype=t.dtype))

    w = copy.blocks[2].attn.wq.weight.view(-1)
    assert w[3] != w[77]
    assert changed(lambda: swap(w, 3, 77))                      # a swap inside a tensor
    assert changed(lambda: ulp(w, 5)) and changed(lambda: ulp(w, 5, -math.inf))
    a, b = copy.blocks[0].attn.wq.weight, copy.blocks[1].attn.wq.weight

    def swap_tensors():
        t = a.clone()
        a.copy_(b)
        b.copy_(t)
    assert changed(swap_tensors)                                # two same-shape tensors swapped

    # Small blocks: the same position in two blocks, the block edges and a partial last block.
    p = nn.Parameter(torch.randn(2500))
    assert changed(lambda: swap(p, 10, 1010), params=lambda: [p], chunk=1000)
    for i in (999, 1000, 2499):
        assert changed(lambda i=i: ulp(p, i), params=lambda: [p], chunk=1000)

    # bf16 parameters: one ulp is the lowest of the 16 bits.
    h = nn.Parameter(torch.randn(300).bfloat16())
    assert changed(lambda: ulp(h, 7), params=lambda: [h])


@pytest.mark.parametrize("world_size", [2, 3])
def test_diag_multiprocess(world_size, tmp_path):
    proc = torchrun(WORKER, world_size, str(tmp_path), timeout=900)
    assert f"diag worker OK at W={world_size}" in proc.stdout
