"""Newton-Schulz coefficient schedules (muon_ns_schedule): fixed (torch.optim.Muon's quintic) and
polar_express (Amsel et al. 2025), against the exact polar factor, their designs, and the trainer; and the
AOL start (muon_ns_precondition=aol, Turbo-Muon's): its bound, its bands, its reference, the trainer."""

from __future__ import annotations

import json
import math

import numpy as np
import pandas as pd
import pytest
import torch

from blunb.config import apply_overrides, preset
from blunb.optim import muon as muon_mod
from blunb.optim.newton_schulz import (
    MUON_COEFFICIENTS,
    NS_SCHEDULES,
    POLAR_EXPRESS_OPTIMAL,
    NewtonSchulz,
    _aol_start,
    _wide,
    resolve_coefficients,
    zeropower_reference,
)
from tests.run_folders import write_completed

# bf16 iterates are rounded every step (2^-9 relative per rounding, a few roundings per step, amplified
# by each polynomial's slope); on these inputs they land at most 0.004 outside the exact-arithmetic bands
# below. 0.02 is the repo's bf16 Newton-Schulz tolerance (tests/test_muon_gpu.py).
BF16 = 0.02


def _composed(schedule: str, steps: int, lo: float) -> np.ndarray:
    """The scalar map the schedule applies to each singular value s / ||G||_F in [lo, 1], in float64."""
    s = NS_SCHEDULES[schedule]
    x = np.logspace(math.log10(lo), 0, 200_001) / s.safety
    for a, b, c in s.per_step(steps):
        x = a * x + b * x**3 + c * x**5
    return x


def test_the_polar_express_table_is_the_papers_minimax_composition():
    """Each composition of the first t optimal polynomials is the best uniform approximation of 1 on
    [l, 1] = [1e-3, 1] (the paper's Theorem 4.1), so it equioscillates: its range there is [1 - E_t, 1 + E_t]
    exactly, with E_t falling to 0. Measured: symmetric to < 1e-12 at every t, E_5 = 0.1236, E_8 < 1e-15.
    A digit mistyped anywhere past the first few of any coefficient breaks the symmetry well above 1e-8."""
    x = np.logspace(-3, 0, 400_001)
    errors = []
    for a, b, c in POLAR_EXPRESS_OPTIMAL:
        x = a * x + b * x**3 + c * x**5
        below, above = 1 - x.min(), x.max() - 1
        assert abs(below - above) < 1e-8 * max(1.0, below), (below, above)
        errors.append(above)
    assert all(e1 < e0 for e0, e1 in zip(errors[:6], errors[1:7])) and errors[-1] < 1e-12
    assert errors[4] == pytest.approx(0.1236, abs=1e-4)


def test_each_schedule_maps_its_design_interval_where_it_should():
    """Exact arithmetic, the inputs' singular values s / ||G||_F spread over each design interval.
    fixed: the quintic's known plateau [0.68, 1.13] from 1e-2 up (it does not converge: both ends are
    reached, and 1e-3 is still at 0.47 after 5 steps). polar_express, from the paper's l = 1e-3 up:
    [0.840, 1.124] after 5 steps, [0.993, 1.002] after 6, 1 within 1e-12 from 8 on (the paper's rule
    repeats the classical quintic, which fixes 1)."""
    fixed = _composed("fixed", 5, 1e-2)
    assert 0.68 < fixed.min() < 0.69 and 1.13 < fixed.max() < 1.135
    assert _composed("fixed", 5, 1e-3).min() < 0.5
    pe5, pe6 = _composed("polar_express", 5, 1e-3), _composed("polar_express", 6, 1e-3)
    assert 0.84 < pe5.min() and pe5.max() < 1.124
    assert 0.993 < pe6.min() and pe6.max() < 1.002
    for steps in (8, 12):
        assert np.abs(_composed("polar_express", steps, 1e-3) - 1).max() < 1e-12
    # tighter: its worst deviation from 1 (0.160) is half the fixed quintic's (0.318), on a 10x wider interval
    assert np.abs(pe5 - 1).max() < 0.17 and np.abs(fixed - 1).max() > 0.31


def test_polar_express_past_its_table_repeats_the_last_polynomial_and_truncates_below_it():
    pe = NS_SCHEDULES["polar_express"].coefficients
    assert len(pe) == len(POLAR_EXPRESS_OPTIMAL) == 8 and pe[-1] == (1.875, -1.25, 0.375)
    assert resolve_coefficients("polar_express", 3) == (list(pe[:3]), 1.01)
    assert resolve_coefficients("polar_express", 12) == (list(pe) + [pe[-1]] * 4, 1.01)
    # the safety factor is p(x / 1.01) on every polynomial but the last (Algorithm 1)
    a, b, c = POLAR_EXPRESS_OPTIMAL[0]
    assert pe[0] == (a / 1.01, b / 1.01**3, c / 1.01**5)
    assert resolve_coefficients("fixed", 7) == ([MUON_COEFFICIENTS] * 7, 1.0)


def test_bad_coefficients_are_refused_naming_the_schedules():
    with pytest.raises(ValueError, match="unknown Newton-Schulz schedule 'polar'; known: fixed, polar_express"):
        NewtonSchulz(coefficients="polar")
    with pytest.raises(ValueError, match="5 .a, b, c. triples, one per step"):
        NewtonSchulz(5, [MUON_COEFFICIENTS] * 4)
    with pytest.raises(ValueError, match="one per step"):
        NewtonSchulz(2, [(1.0, 2.0), (1.0, 2.0)])
    with pytest.raises(ValueError, match="ns_steps must be >= 1"):
        NewtonSchulz(0, "polar_express")
    with pytest.raises(ValueError, match="unknown Newton-Schulz precondition 'AOL'; known: none, aol"):
        NewtonSchulz(precondition="AOL")
    with pytest.raises(ValueError, match="unknown Newton-Schulz precondition 'jacobi'"):
        zeropower_reference(torch.ones(4, 6), precondition="jacobi")


def _design(shape, lo, gen):
    """Random singular vectors, singular values 1 and log-spaced over [lo, 0.1] (s / ||G||_F from ~lo to ~1)."""
    *batch, m, n = shape
    k = min(m, n)
    out = []
    for _ in range(batch[0] if batch else 1):
        U, _ = torch.linalg.qr(torch.randn(m, k, generator=gen, dtype=torch.float64))
        V, _ = torch.linalg.qr(torch.randn(n, k, generator=gen, dtype=torch.float64))
        s = torch.logspace(math.log10(lo), -1, k - 1, dtype=torch.float64)
        out.append(((U * torch.cat([s.new_ones(1), s])) @ V.T).float())
    return torch.stack(out) if batch else out[0]


def _inputs():
    """Fresh matrices, odd tall / wide / batched shapes: Gaussian ones (s / ||G||_F ~0.06-0.3) and ones
    spread over [1e-2, 1]. Not down to 1e-3: the input's own bf16 rounding moves singular values of
    ~1e-3 ||G||_F by tens of percent, so that range is held in exact arithmetic (above)."""
    gen = torch.Generator().manual_seed(0)
    gauss = [torch.randn(*s, generator=gen) for s in [(37, 101), (101, 37), (64, 160), (200, 75), (3, 45, 77),
                                                        (3, 77, 45)]]
    return gauss + [_design(s, 1e-2, gen) for s in [(97, 97), (53, 131), (131, 53), (2, 64, 64)]]


@pytest.mark.parametrize("schedule, steps, lo, hi, dist", [
    ("fixed", 5, 0.6818, 1.1344, 0.34),           # measured [0.680, 1.138], ||X - UV^T||_2 <= 0.320
    ("polar_express", 5, 0.8703, 1.1236, 0.15),   # measured [0.868, 1.125], 0.134
    ("polar_express", 8, 1.0, 1.0, 0.05),         # measured [0.996, 1.005], 0.031
    ("polar_express", 12, 1.0, 1.0, 0.05),        # the same
])
def test_the_bf16_engine_lands_where_each_schedule_says(schedule, steps, lo, hi, dist):
    """The engine as the optimizer runs it (bf16) against the exact polar factor U V^T of its bf16 input
    (float64 SVD): every singular value of the output within the exact-arithmetic band of its schedule
    over [1e-2, 1] (lo, hi) widened by BF16, and the output within `dist` of U V^T in the spectral norm:
    the band's deviation from 1, plus the turn bf16 rounding of the iterates (~2^-9 ||X||) gives the
    singular vectors of the smallest singular values (1e-2 ||G||_F here), a few percent at most."""
    ns = NewtonSchulz(steps, schedule, graphs=False)
    seen_lo, seen_hi = math.inf, 0.0
    for G in _inputs():
        out = ns(G)
        assert out.dtype == torch.bfloat16 and out.shape == G.shape
        U, _, Vh = torch.linalg.svd(G.bfloat16().double(), full_matrices=False)
        sv = torch.linalg.svdvals(out.double())
        seen_lo, seen_hi = min(seen_lo, float(sv.min())), max(seen_hi, float(sv.max()))
        assert float(torch.linalg.matrix_norm(out.double() - U @ Vh, ord=2).max()) < dist
    assert lo - BF16 < seen_lo and seen_hi < hi + BF16, (seen_lo, seen_hi)
    if schedule == "fixed":  # the quintic's plateau is reached, not only bounded
        assert seen_lo < 0.7 and seen_hi > 1.12


@pytest.mark.parametrize("shape", [(37, 101), (101, 37), (64, 64), (3, 45, 77), (3, 77, 45)])
def test_the_fixed_schedule_per_iteration_is_todays_path_bit_for_bit(shape):
    """Given as one triple per iteration, the fixed schedule is the same computation as before schedules
    existed (torch.optim.Muon's _zeropower_via_newtonschulz, which the engine matched bitwise): every bit."""
    from torch.optim._muon import _zeropower_via_newtonschulz
    torch.manual_seed(0)
    G = torch.randn(*shape)
    G3 = G if G.dim() == 3 else G[None]
    torch_muon = torch.stack([_zeropower_via_newtonschulz(g, MUON_COEFFICIENTS, 5, 1e-7) for g in G3])
    per_step = NewtonSchulz(5, [MUON_COEFFICIENTS] * 5, graphs=False)(G3)
    assert torch.equal(per_step, torch_muon)
    assert torch.equal(NewtonSchulz(graphs=False)(G3), torch_muon)
    assert torch.equal(NewtonSchulz(graphs=False, precondition="none")(G3), torch_muon)


@pytest.mark.parametrize("shape", [(37, 101), (101, 37), (64, 64), (3, 45, 77), (3, 77, 45)])
def test_polar_express_without_a_precondition_is_the_iteration_from_before_the_option_bit_for_bit(shape):
    """The default start (precondition none) runs the same ops as before the AOL option existed: the
    pre-option engine's iteration, restated here in plain batched torch (safety factor and all), every bit."""
    torch.manual_seed(0)
    G = torch.randn(*shape)
    G3 = G if G.dim() == 3 else G[None]
    schedule = NS_SCHEDULES["polar_express"]
    X = G3.bfloat16()
    X = X / (torch.linalg.vector_norm(X, dim=(-2, -1), keepdim=True) * schedule.safety + 1e-7)
    tall = X.shape[-2] > X.shape[-1]
    for a, b, c in schedule.per_step(5):
        Xw = X.mT if tall else X
        A = torch.bmm(Xw, Xw.mT)
        B = torch.baddbmm(A, A, A, beta=b, alpha=c)
        X = torch.baddbmm(X, X, B, beta=a) if tall else torch.baddbmm(X, B, X, beta=a)
    assert torch.equal(NewtonSchulz(5, "polar_express", graphs=False, precondition="none")(G3), X)


@pytest.mark.parametrize("shape", [(37, 101), (101, 37), (64, 64)])
def test_each_iteration_gets_its_own_coefficients_in_order(shape):
    """The batched engine applies step k's triple at step k: equal (bitwise, on this CPU) to the plain
    2-D loop with the same schedule, and different from the same triples in reverse order."""
    torch.manual_seed(0)
    G = torch.randn(*shape)
    out = NewtonSchulz(5, "polar_express", graphs=False)(G)
    assert torch.equal(out, zeropower_reference(G, 5, "polar_express"))
    steps = list(NS_SCHEDULES["polar_express"].coefficients[:5])
    forward = NewtonSchulz(5, steps, graphs=False)(G)
    backward = NewtonSchulz(5, steps[::-1], graphs=False)(G)
    assert torch.equal(forward, zeropower_reference(G, 5, steps))
    assert not torch.equal(forward, backward)


@pytest.fixture
def engines(monkeypatch):
    """Every Newton-Schulz engine ShardedMuon builds, in order."""
    built = []
    real = muon_mod.NewtonSchulz

    def spy(*args, **kwargs):
        built.append(real(*args, **kwargs))
        return built[-1]
    monkeypatch.setattr(muon_mod, "NewtonSchulz", spy)
    return built


def test_a_muon_run_trains_with_polar_express_and_records_it(tmp_path, engines):
    """A few real steps of the tiny preset through blunb.train: the optimizer's engine has the schedule's
    coefficients, and config.json, env.json and the start-of-run line say which schedule ran."""
    from blunb.train import train

    cfg = apply_overrides(preset("tiny"), ["optimizer=muon", "muon_ns_schedule=polar_express"])
    cfg.rescale_schedule(4)
    run_dir = train(cfg, tmp_path / "pe")
    (ns,) = engines
    assert ns.schedule == "polar_express" and ns.safety == 1.01
    assert ns.coefficients == tuple(NS_SCHEDULES["polar_express"].coefficients[:5])
    assert json.loads((run_dir / "config.json").read_text())["muon_ns_schedule"] == "polar_express"
    env = json.loads((run_dir / "env.json").read_text())
    assert env["training"]["optimizer"]["muon"]["ns_schedule"] == "polar_express"
    assert "NS5 polar_express" in (run_dir / "log.txt").read_text()
    m = pd.read_csv(run_dir / "metrics.csv")
    assert list(m["step"]) == [0, 1, 2, 3] and m["train_loss"].map(math.isfinite).all()
    assert (m["ns_rejected"] == 0).all() and m["nsratio"].between(0.5, 1.5).all()   # healthy updates
    assert json.loads((run_dir / "status.json").read_text())["state"] == "completed"


def test_the_study_cache_reads_a_run_from_before_the_setting_as_fixed(tmp_path):
    """A completed run folder whose config.json predates muon_ns_schedule ran the fixed coefficients:
    the study cache takes it for a fixed arm and re-runs it for a polar_express arm."""
    from blunb.study import Study

    arms = {"fixed": ["optimizer=muon"], "pe": ["optimizer=muon", "muon_ns_schedule=polar_express"]}
    for plan in Study("s", arms, seeds=[0], steps=4, root=tmp_path)._plan():
        old = json.loads(json.dumps(plan.config))
        del old["muon_ns_schedule"]
        plan.run_dir.mkdir(parents=True)
        (plan.run_dir / "config.json").write_text(json.dumps(old))
        (plan.run_dir / "env.json").write_text(json.dumps({"world_size": 1}))
        write_completed(plan.run_dir, 4)
    actions = {p.arm: p.action for p in Study("s", arms, seeds=[0], steps=4, root=tmp_path)._plan()}
    assert actions == {"fixed": "cached", "pe": "overwrite"}


# -- the AOL start (muon_ns_precondition=aol) ------------------------------------------------------------------

def _row_spread(shape, gen):
    """Gaussian, its rows (the wide orientation's) scaled by norms log-spread over [1e-2, 1]: gradients whose rows
    differ in scale, the case a diagonal rescaling is for."""
    G = torch.randn(*shape, generator=gen)
    m, n = shape[-2:]
    r = torch.logspace(-2, 0, min(m, n))[torch.randperm(min(m, n), generator=gen)]
    return G * (r[:, None] if m <= n else r[None, :])


def _aol_inputs():
    """Fresh gradient-like matrices, odd tall / wide / batched shapes (no square Gaussian: its smallest singular
    value is ~0, which no start fixes): Gaussian, row-spread, and adversarial ones (a rank-1 matrix with rows of
    spread norms, a zero row, heavy-tailed Cauchy entries, all ones, all zeros)."""
    gen = torch.Generator().manual_seed(1)
    shapes = [(37, 101), (101, 37), (64, 160), (200, 75), (3, 45, 77), (3, 77, 45)]
    u, v = torch.randn(50, 1, generator=gen), torch.randn(1, 80, generator=gen)
    zero_row = torch.randn(40, 90, generator=gen)
    zero_row[3] = 0
    cauchy = torch.tan(math.pi * (torch.rand(70, 45, generator=gen) - 0.5))
    return ([torch.randn(*s, generator=gen) for s in shapes] + [_row_spread(s, gen) for s in shapes]
            + [(u * torch.logspace(-3, 0, 50)[:, None]) @ v, zero_row, cauchy, torch.ones(33, 65), torch.zeros(20, 30)])


def _frobenius_start(G: torch.Tensor, dtype) -> torch.Tensor:
    """The engine's input to the first iteration without a precondition: [b, rows, cols], X / ||X||_F."""
    X = (G if G.dim() == 3 else G[None]).to(dtype)
    return X / torch.linalg.vector_norm(X, dim=(-2, -1), keepdim=True).clamp(min=1e-7)


@pytest.mark.parametrize("dtype, tol", [
    (torch.float64, 1e-12),   # measured 4e-16: the bound is exact, this is fp64 round-off
    (torch.float32, 1e-5),    # measured 5e-7
    # the engine's own: s and the scaled entries each rounded to bf16 (<= 2^-9 relative each, so <= ~2^-8 on
    # the norm); measured 0.0015
    (torch.bfloat16, 2.0**-8),
])
@pytest.mark.parametrize("safety", [1.0, 1.01])
def test_the_aol_start_has_spectral_norm_at_most_one_over_the_safety_factor(dtype, tol, safety):
    """AOL's guarantee (Prach & Lampert 2022, Theorem 1), on the engine's own start function and Gram, in either
    orientation: ||diag(s) X||_2 <= 1 / safety, never a non-finite value (zero rows and the zero matrix included),
    and the Gram it hands on is the scaled matrix's Gram (exactly symmetric; up to rounding otherwise)."""
    for G in _aol_inputs():
        X = _frobenius_start(G, dtype)
        Xw = _wide(X)
        # the Gram as the GPU's SYRK hands it over: exactly symmetric (one triangle mirrored). A CPU bmm's fp64
        # Gram may differ from its transpose in the last bit (seen on an AMD EPYC), and that is not _aol_start's
        A = torch.bmm(Xw, Xw.mT).triu()
        Xs, As = _aol_start(X, A + A.triu(1).mT, safety, 1e-7)
        assert Xs.dtype == dtype and Xs.shape == X.shape and torch.isfinite(Xs).all()
        norm = float(torch.linalg.matrix_norm(Xs.double(), ord=2).max())
        assert norm <= (1 + tol) / safety, (tuple(G.shape), norm)
        assert torch.equal(As, As.mT)
        gram = _wide(Xs).double() @ _wide(Xs).double().mT
        assert float((As.double() - gram).abs().max()) <= 4 * tol


def test_the_aol_start_lifts_the_small_singular_values_of_gradient_like_inputs():
    """Exact arithmetic (fp64): the smallest singular value of the start, AOL's over the Frobenius-normalized
    one. Measured 2.9-3.8x on Gaussian matrices, 19-26x on row-spread ones (AOL undoes most of the row scaling)."""
    gen = torch.Generator().manual_seed(2)
    shapes = [(37, 101), (101, 37), (64, 160), (200, 75), (3, 45, 77), (3, 77, 45)]
    for family, low in (("gauss", 2.5), ("row-spread", 15.0)):
        for shape in shapes:
            G = torch.randn(*shape, generator=gen) if family == "gauss" else _row_spread(shape, gen)
            X = _frobenius_start(G, torch.float64)
            Xw = _wide(X)
            Xs, _ = _aol_start(X, Xw @ Xw.mT, 1.0, 1e-7)
            gain = torch.linalg.svdvals(Xs).min(dim=-1).values / torch.linalg.svdvals(X).min(dim=-1).values
            assert float(gain.min()) > low, (family, shape, gain)


@pytest.mark.parametrize("schedule", ["fixed", "polar_express"])
@pytest.mark.parametrize("steps", [1, 4, 5])
@pytest.mark.parametrize("shape", [(37, 101), (101, 37), (64, 64), (3, 45, 77), (3, 77, 45)])
def test_the_engine_with_aol_is_the_reference_bit_for_bit(schedule, steps, shape):
    """The batched engine (bmm, a tall X in its own layout, the Gram reused) against zeropower_reference (plain
    2-D ops on the wide transpose, one matrix at a time): every bit, on this CPU; and AOL changes the result."""
    torch.manual_seed(0)
    G = torch.randn(*shape)
    G3 = G if G.dim() == 3 else G[None]
    out = NewtonSchulz(steps, schedule, graphs=False, precondition="aol")(G3)
    ref = torch.stack([zeropower_reference(g, steps, schedule, precondition="aol") for g in G3])
    assert torch.equal(out, ref)
    assert not torch.equal(out, NewtonSchulz(steps, schedule, graphs=False)(G3))


@pytest.mark.parametrize("schedule, steps, lo, hi", [
    ("fixed", 5, 0.6818, 1.1344),           # measured [0.679, 1.138]: no precondition [0.680, 1.138]
    ("polar_express", 5, 0.8703, 1.1236),   # measured [0.866, 1.126]: no precondition [0.867, 1.125]
])
def test_the_bf16_engine_with_aol_lands_in_the_schedules_band(schedule, steps, lo, hi):
    """The AOL start changes no schedule's design: on the schedule tests' inputs (Gaussian, and spectra spread
    over [1e-2, 1] with random singular vectors, where AOL gains little) every output singular value lies in the
    schedule's exact-arithmetic band widened by BF16, as without it."""
    ns = NewtonSchulz(steps, schedule, graphs=False, precondition="aol")
    sv = torch.cat([torch.linalg.svdvals(ns(G).double()).flatten() for G in _inputs()])
    assert lo - BF16 < float(sv.min()) and float(sv.max()) < hi + BF16, (float(sv.min()), float(sv.max()))


def test_with_aol_the_fixed_quintic_needs_one_iteration_less_on_row_spread_gradients():
    """Turbo-Muon's claim, for our fixed quintic: on row-spread inputs (their smallest singular value ~1e-3 of
    ||G||_F), 4 iterations from the AOL start land in the quintic's plateau, [0.68, 1.14] (measured [0.679, 1.139]),
    which 5 from the Frobenius start reach only just (measured [0.677, 1.204]), 4 not at all (measured 0.303).
    polar_express is bound by its design instead: after 4 steps its band is [0.44, 1.56] whatever the start
    (measured with AOL [0.437, 1.562]), so it needs its 5 steps with or without AOL."""
    gen = torch.Generator().manual_seed(3)
    inputs = [_row_spread(s, gen) for s in [(37, 101), (101, 37), (64, 160), (200, 75), (3, 45, 77), (3, 77, 45)]]

    def band(steps, schedule="fixed", precondition="none"):
        ns = NewtonSchulz(steps, schedule, graphs=False, precondition=precondition)
        sv = torch.cat([torch.linalg.svdvals(ns(G).double()).flatten() for G in inputs])
        return float(sv.min()), float(sv.max())

    aol4, none4, none5 = band(4, precondition="aol"), band(4), band(5)
    assert 0.6818 - BF16 < aol4[0] and aol4[1] < 1.1344 + BF16, aol4
    assert none4[0] < 0.4 and none5[0] > 0.6818 - BF16, (none4, none5)
    pe4 = band(4, "polar_express", "aol")
    assert 0.4396 - BF16 < pe4[0] < 0.5 and 1.5 < pe4[1] < 1.5604 + BF16, pe4


def test_a_muon_run_trains_with_the_aol_start_and_records_it(tmp_path, engines):
    """A few real steps of the tiny preset through blunb.train with muon_ns_precondition=aol at 4 steps: the
    optimizer steps with an AOL engine, and config.json, env.json and the start-of-run line say so."""
    from blunb.train import train


    cfg = apply_overrides(preset("tiny"), ["optimizer=muon", "muon_ns_precondition=aol", "muon_ns_steps=4"])
    cfg.rescale_schedule(4)
    run_dir = train(cfg, tmp_path / "aol")
    (aol,) = engines   # ShardedMuon's engine, built with the setting
    assert aol.precondition == "aol" and aol.coefficients == (MUON_COEFFICIENTS,) * 4
    assert sum(s.calls for s in aol._slots.values()) > 0
    config = json.loads((run_dir / "config.json").read_text())
    assert config["muon_ns_precondition"] == "aol" and config["muon_ns_steps"] == 4
    muon_facts = json.loads((run_dir / "env.json").read_text())["training"]["optimizer"]["muon"]
    assert muon_facts["ns_precondition"] == "aol" and muon_facts["ns_schedule"] == "fixed"
    assert "NS4 fixed+aol" in (run_dir / "log.txt").read_text()
    m = pd.read_csv(run_dir / "metrics.csv")
    assert list(m["step"]) == [0, 1, 2, 3] and m["train_loss"].map(math.isfinite).all()
    assert (m["ns_rejected"] == 0).all() and m["nsratio"].between(0.5, 1.5).all()   # healthy updates
    assert json.loads((run_dir / "status.json").read_text())["state"] == "completed"
