"""blunb.claims: each verdict rule on evidence with a known answer, the spec checks, and the studies' specs."""

import math
import types

import numpy as np
import pandas as pd
import pytest

from blunb.claims import COLUMNS, RESULTS, Claim, Evidence, Spec, SpecError, evaluate, load_spec
from blunb.stats import mean_ci, paired_diff_ci, paired_tost, ratio_ci
from tests.distributed import REPO

SPECS = sorted((REPO / "notebooks").glob("*_claims.py"))


def claim(id="c", test="band", **kw):
    return Claim(id, source="the reference says so", figure="its section 1", statistic="a number", test=test, **kw)


def spec_file(tmp_path, body, name="s_claims.py"):
    path = tmp_path / name
    path.write_text("import math\nfrom blunb.claims import Claim\n" + body)
    return path


def one(tmp_path, c: Claim, ev: Evidence | None):
    """The table row of a one-claim spec."""
    spec = Spec(tmp_path / "one_claims.py", (c,), {"preset": "124m"}, types.ModuleType("one_claims"))
    return evaluate(spec, {} if ev is None else {c.id: ev}).iloc[0]


@pytest.fixture
def base_spec(tmp_path):
    return spec_file(tmp_path, "CLAIMS = [Claim('a', 's', 'f', 'x', 'exact', band=(0, 1))]\nGPU_SCALE = {'p': 1}\n")


# ---------------------------------------------------------------- the rules

def test_tost_passes_fails_and_is_inconclusive_on_real_tosts(tmp_path):
    c = claim(test="tost", margin=0.02, min_seeds=6)
    base = np.full(6, 2.0)
    close = base + np.array([0.001, -0.002, 0.0015, 0.0, -0.001, 0.0005])
    far = base + 0.1 + np.array([0.001, -0.002, 0.0015, 0.0, -0.001, 0.0005])
    noisy = base + np.array([0.05, -0.04, 0.03, -0.06, 0.02, 0.0])
    rows = {name: one(tmp_path, c, Evidence.of(paired_tost(a, base, 0.02)))
            for name, a in (("close", close), ("far", far), ("noisy", noisy))}
    assert (rows["close"]["result"], rows["close"]["verdict"]) == ("pass", True)
    assert (rows["far"]["result"], rows["far"]["verdict"]) == ("fail", False)
    assert (rows["noisy"]["result"], rows["noisy"]["verdict"]) == ("inconclusive", False)
    assert rows["close"]["margin_or_band"] == "+-0.02" and rows["close"]["n"] == 6
    # the committed clipping AdamW A/B (final val loss per_group - global, seeds 0-2) against +-0.02: its
    # 90% interval straddles both margins, so inconclusive -- not "inside the noise" (here: too few seeds too)
    a, b = [2.212902, 2.402322, 2.167680], [2.160275, 2.423383, 2.178720]
    t = paired_tost(a, b, 0.02)
    assert t.lo < -0.02 and t.hi > 0.02
    assert one(tmp_path, claim(test="tost", margin=0.02), Evidence.of(t))["result"] == "inconclusive"
    assert one(tmp_path, c, Evidence.of(t))["result"] == "too few seeds"


def test_a_wide_interval_never_passes_a_band(tmp_path):
    c = claim(band=(0.07, 0.11))
    wide = Evidence(0.09, 0.01, 0.5, n=3)                     # centred in the band, but wider than it
    assert one(tmp_path, c, wide)["result"] == "inconclusive"
    assert one(tmp_path, c, Evidence(0.09, 0.08, 0.10, n=3))["result"] == "pass"
    assert one(tmp_path, c, Evidence(0.25, 0.20, 0.30, n=3))["result"] == "fail"   # disjoint
    # the same rule for a CI test and a ratio test
    for test in ("diff_ci", "ratio_ci"):
        assert one(tmp_path, claim(test=test, band=(0.5, 0.7)), Evidence(0.6, 0.1, 2.0, n=4))["verdict"] == False  # noqa: E712 (a verdict is True, False or "n/a")


def test_one_sided_band_and_the_confidence_the_evidence_should_carry(tmp_path):
    worse = claim(test="diff_ci", band=(0.0, math.inf), alpha=0.05)
    assert worse.confidence == pytest.approx(0.90)                 # its lower edge: the one-sided 95% bound
    assert claim(band=(0.0, 1.0)).confidence == pytest.approx(0.95)
    assert claim(test="tost", margin=0.1).confidence == pytest.approx(0.90)
    a, b = [2.84, 2.76, 2.80, 2.83], [2.73, 2.72, 2.71, 2.74]
    row = one(tmp_path, worse, Evidence.of(paired_diff_ci(a, b, worse.confidence)))
    assert row["result"] == "pass" and row["margin_or_band"] == "[0, inf]"
    row = one(tmp_path, worse, Evidence.of(paired_diff_ci(b, a, worse.confidence)))
    assert row["result"] == "fail"


def test_ratio_evidence_and_mean_ci_evidence(tmp_path):
    r = ratio_ci([1.0, 1.1, 0.9], [2.0, 2.0, 2.0])
    row = one(tmp_path, claim(test="ratio_ci", band=(0.25, 1.0)), Evidence.of(r, "half as much"))
    assert row["result"] == "pass" and row["estimate"] == pytest.approx(r.estimate) and row["detail"] == "half as much"
    m = mean_ci([1.5, 1.4, 1.6])
    assert one(tmp_path, claim(band=(1.0, math.inf)), Evidence.of(m))["result"] == "pass"
    with pytest.raises(TypeError, match="Interval, Tost or MeanCI"):
        Evidence.of((1.0, 0.0, 2.0))


def test_exact_reads_the_estimate_alone(tmp_path):
    c = claim(test="exact", band=(0.0, 0.0))
    assert one(tmp_path, c, Evidence(0.0))["result"] == "pass"
    assert one(tmp_path, c, Evidence(1e-9))["result"] == "fail"
    assert one(tmp_path, c, Evidence(float("nan")))["result"] == "inconclusive"   # nothing measured


def test_too_few_seeds_comes_before_the_test(tmp_path):
    c = claim(band=(0.0, 1.0), min_seeds=6)
    row = one(tmp_path, c, Evidence(0.5, 0.4, 0.6, n=3))        # would pass with 6
    assert (row["result"], row["verdict"]) == ("too few seeds", False)
    assert one(tmp_path, c, Evidence(0.5, 0.4, 0.6, n=6))["result"] == "pass"
    # one seed: no interval, so nothing is shown even where one seed is allowed
    assert one(tmp_path, claim(band=(0.0, 1.0)), Evidence(0.5, float("nan"), float("nan")))["result"] == "inconclusive"


def test_na_claims_descriptive_rows_and_na_evidence(tmp_path):
    na = claim(test="n/a", na_reason="one GPU: nothing to overlap")
    row = one(tmp_path, na, None)
    assert (row["result"], row["verdict"], row["margin_or_band"]) == ("n/a", "n/a", "")
    assert row["detail"] == "n/a: one GPU: nothing to overlap" and row["n"] == 0 and math.isnan(row["estimate"])
    descr = claim(test="diff_ci", na_reason="no claim asks")
    row = one(tmp_path, descr, Evidence(0.057, 0.02, 0.09, n=2, detail="+0.057"))
    assert (row["result"], row["verdict"], row["estimate"]) == ("n/a", "n/a", 0.057)
    assert row["detail"] == "+0.057; descriptive: no claim asks"
    with pytest.raises(SpecError, match="no evidence"):
        one(tmp_path, descr, None)                                # descriptive: still computed
    cuda = one(tmp_path, claim(band=(0.75, 1.25)), Evidence(float("nan"), na_reason="CUDA only"))
    assert (cuda["result"], cuda["verdict"], cuda["detail"]) == ("n/a", "n/a", "n/a: CUDA only")


def test_missing_and_unknown_evidence_are_errors(base_spec):
    spec = load_spec(base_spec)
    with pytest.raises(SpecError, match=r"no evidence for the declared claims \['a'\]"):
        evaluate(spec, {})
    with pytest.raises(SpecError, match=r"does not declare: \['b'\]"):
        evaluate(spec, {"a": Evidence(0.5), "b": Evidence(0.5)})
    with pytest.raises(SpecError, match="must be a blunb.claims.Evidence"):
        evaluate(spec, {"a": 0.5})


def test_a_ci_test_without_an_interval_is_an_error(tmp_path):
    with pytest.raises(SpecError, match="needs an interval"):
        one(tmp_path, claim(band=(0.0, 1.0)), Evidence(0.5))


def test_the_table_has_the_declared_columns_and_writes_true_false_na(tmp_path):
    body = ("CLAIMS = [Claim('p', 's', 'f', 'x', 'exact', band=(0, 1)), Claim('q', 's', 'f', 'x', 'exact', "
            "band=(0, 1)), Claim('r', 's', 'f', 'x', 'n/a', na_reason='cannot')]\nGPU_SCALE = {'p': 1}\n")
    table = evaluate(load_spec(spec_file(tmp_path, body, "t_claims.py")), {"p": Evidence(0.5), "q": Evidence(2.0)})
    assert list(table.columns) == COLUMNS and list(table["id"]) == ["p", "q", "r"]
    assert set(table["result"]) <= set(RESULTS)
    table.to_csv(tmp_path / "claims.csv", index=False)
    # (pandas reads "n/a" as NaN unless told not to)
    on_disk = pd.read_csv(tmp_path / "claims.csv", dtype=str, keep_default_na=False)
    assert on_disk["verdict"].tolist() == ["True", "False", "n/a"]
    assert on_disk["result"].tolist() == ["pass", "fail", "n/a"]


# ---------------------------------------------------------------- declaring

@pytest.mark.parametrize("kw, match", [
    ({"test": "maybe"}, "test must be one of"),
    ({"test": "tost"}, "finite margin > 0"),
    ({"test": "tost", "margin": 0.0}, "finite margin > 0"),
    ({"test": "tost", "margin": 0.02, "band": (0, 1)}, "a margin, not a band"),
    ({"test": "band"}, "needs a band"),
    ({"test": "band", "band": (1.0, 0.0)}, "lo <= hi"),
    ({"test": "band", "band": (-math.inf, math.inf)}, "at most one side infinite"),
    ({"test": "band", "band": (0, 1), "margin": 0.1}, "a band, not a margin"),
    ({"test": "n/a"}, "needs its na_reason"),
    ({"test": "n/a", "na_reason": "x", "band": (0, 1)}, "no margin or band"),
    ({"test": "exact", "band": (0, 1), "alpha": 0.5}, "alpha"),
    ({"test": "exact", "band": (0, 1), "min_seeds": 0}, "min_seeds"),
])
def test_a_bad_claim_is_refused_when_declared(kw, match):
    with pytest.raises(SpecError, match=match):
        claim(**kw)
    with pytest.raises(SpecError, match="non-empty"):
        Claim("x", source="", figure="f", statistic="s", test="n/a", na_reason="r")


def test_load_spec_checks_the_file(tmp_path):
    with pytest.raises(SpecError, match="no spec file"):
        load_spec(tmp_path / "nope.py")
    with pytest.raises(SpecError, match="must define CLAIMS"):
        load_spec(spec_file(tmp_path, "GPU_SCALE = {'p': 1}\n"))
    dup = "CLAIMS = [Claim('a', 's', 'f', 'x', 'exact', band=(0, 1))] * 2\nGPU_SCALE = {'p': 1}\n"
    with pytest.raises(SpecError, match=r"repeated: \['a'\]"):
        load_spec(spec_file(tmp_path, dup))
    with pytest.raises(SpecError, match="GPU_SCALE"):
        load_spec(spec_file(tmp_path, "CLAIMS = [Claim('a', 's', 'f', 'x', 'exact', band=(0, 1))]\n"))
    spec = load_spec(spec_file(tmp_path, "X = 3\nCLAIMS = [Claim('a', 's', 'f', 'x', 'exact', band=(0, 1))]\n"
                               "GPU_SCALE = {'p': 1}\n"))
    assert spec.module.X == 3 and spec.claim("a").band == (0, 1) and spec.gpu_scale == {"p": 1}
    with pytest.raises(SpecError, match="declares no claim 'z'"):
        spec.claim("z")


@pytest.mark.parametrize("path", SPECS, ids=lambda p: p.name)
def test_each_studys_spec_loads(path):
    spec = load_spec(path)
    for c in spec.claims:
        assert c.figure and c.source and c.statistic
        if c.test == "tost":
            assert c.min_seeds > 1, f"{c.id}: an equivalence from one seed"


def test_the_clipping_and_precision_specs_say_what_the_issue_asks():
    clip = load_spec(REPO / "notebooks" / "10_clipping_claims.py")
    prec = load_spec(REPO / "notebooks" / "11_precision_claims.py")
    for g in (clip.gpu_scale, prec.gpu_scale):  # issue 31's scale: the reference's 2000-step WSD shape
        assert (g["preset"], g["max_steps"], g["warmup_steps"], g["stable_steps"]) == ("124m", 2000, 200, 1400)
        assert "bpe:16384" in g["corpus"] and g["tokens_per_step"] > 0
    assert all(clip.gpu_scale["seeds"][arm] >= 6 for arm in
               ("adamw-per_group", "adamw-global", "muon-per_group", "muon-global_strict"))
    for opt in ("adamw", "muon"):
        ab = clip.claim(f"clip.ab_equivalent.{opt}")
        assert ab.test == "tost" and ab.margin == pytest.approx(0.02) and ab.min_seeds >= 6
    share = clip.claim("clip.rest_sq_share.muon")
    assert share.test == "band" and share.band[0] <= 0.07 and 0.11 <= share.band[1] < 0.25  # the reference's 7-11%
    assert "stable" in share.statistic
    drift = clip.claim("clip.strict_coef_drift.muon")
    assert drift.test == "ratio_ci" and drift.band[0] < 0.18 / 0.52 < drift.band[1] < 1.0  # a fall, as the reference's
    assert prec.claim("prec.bf16_logits_equivalent").test == "tost"
    worse = prec.claim("prec.no_master_loss_worse")
    assert worse.test == "diff_ci" and worse.band == (0.0, math.inf)
    assert prec.claim("prec.bf16_resid_loss").descriptive
    g = prec.gpu_scale
    assert min(g["seeds"].values()) >= 4 and g["max_steps"] >= 1000
    assert list(g["seeds"]) == g["arms"] and g["runs"] == sum(g["seeds"].values())
    # issue 30: the loss cost of FP8 body Linears, a paired TOST per recipe against fp32_layout with 6+ seeds
    for arm in ("fp8_tensorwise", "fp8_rowwise"):
        fp8 = prec.claim(f"prec.{arm}_equivalent")
        assert fp8.test == "tost" and fp8.margin == pytest.approx(0.02) and fp8.min_seeds >= 6
        assert "no claim of the reference" in fp8.source
        assert g["seeds"][arm] >= fp8.min_seeds and g["seeds"]["fp32_layout"] >= fp8.min_seeds
    assert prec.claim("prec.fp8_body_gemms_only").band == (0, 0)
