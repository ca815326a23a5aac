"""The studies' declared claims (notebooks/*_claims.py, blunb.claims): every spec file loads, every
claim is well-formed (a known test, a reason for n/a, a margin for TOST, a band where the test reads
one unless the claim is descriptive and says why, unique ids), and the notebook next to it computes
evidence for every claim it must evaluate.

The evidence check is static (the notebooks train runs): each claim id that is not n/a must be
named in the notebook's code by a string, or by an f-string whose fixed parts match it (e.g.
f"reduce.bf16_within_noise_{opt}"), and the notebook must load its own spec file.
"""

from __future__ import annotations

import ast
import json
import math
import re

import pytest

from blunb.claims import load_spec
from tests.distributed import REPO

SPECS = sorted((REPO / "notebooks").glob("*_claims.py"))
TESTS = {"tost", "diff_ci", "ratio_ci", "band", "exact", "n/a"}
BANDED = {"diff_ci", "ratio_ci", "band", "exact"}
_ID = re.compile(r"^[a-z0-9_]+(\.[a-z0-9_]+)+$")


def _notebook_of(spec_path):
    return spec_path.with_name(spec_path.name.removesuffix("_claims.py") + ".ipynb")


def _code(notebook) -> str:
    cells = json.loads(notebook.read_text())["cells"]
    return "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "code")


def _string_patterns(code: str) -> list[re.Pattern]:
    """Every string constant of the code, and every f-string as a pattern (its fields match anything)."""
    tree = ast.parse(code)
    inside_fstrings = {id(v) for node in ast.walk(tree) if isinstance(node, ast.JoinedStr) for v in node.values}
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.JoinedStr):
            # Only an f-string that begins with its study's prefix ("reduce.") names claims: f"{a}.{b}" would
            # match every id.
            head = node.values[0] if node.values else None
            if isinstance(head, ast.Constant) and "." in head.value:
                parts = [re.escape(v.value) if isinstance(v, ast.Constant) else ".+" for v in node.values]
                out.append(re.compile("".join(parts)))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in inside_fstrings:
            out.append(re.compile(re.escape(node.value)))
    return out


def test_every_study_notebook_has_a_spec():
    have = {p.name for p in SPECS}
    for nb in ("10_clipping", "11_precision", "12_overlap", "13_muon_vs_adamw"):
        assert f"{nb}_claims.py" in have, f"notebooks/{nb}_claims.py is missing"


@pytest.mark.parametrize("path", SPECS, ids=lambda p: p.name)
def test_spec_claims_are_well_formed(path):
    spec = load_spec(path)
    assert isinstance(spec.gpu_scale, dict) and spec.gpu_scale, f"{path.name}: GPU_SCALE must be a non-empty dict"
    claims = spec.claims
    assert claims, f"{path.name} declares no claims"
    ids = [c.id for c in claims]
    assert len(ids) == len(set(ids)), f"{path.name}: duplicate ids {sorted({i for i in ids if ids.count(i) > 1})}"
    for c in claims:
        where = f"{path.name}, {c.id}"
        assert _ID.match(c.id), f"{where}: an id is 'study.short_name' (lower case, dots), got {c.id!r}"
        assert c.test in TESTS, f"{where}: test {c.test!r} is not one of {sorted(TESTS)}"
        for field in ("source", "figure", "statistic"):
            assert getattr(c, field).strip(), f"{where}: empty {field}"
        assert 0 < c.alpha < 0.5, f"{where}: alpha {c.alpha}"
        assert isinstance(c.min_seeds, int) and c.min_seeds >= 1, f"{where}: min_seeds {c.min_seeds!r}"
        if c.test == "n/a":
            assert c.na_reason and c.na_reason.strip(), f"{where}: an n/a claim states why"
            continue
        if c.test == "tost":
            assert c.margin is not None and math.isfinite(c.margin) and c.margin > 0, \
                f"{where}: TOST needs a margin > 0"
            assert not c.na_reason, f"{where}: na_reason on a tested claim"
        if c.test in BANDED:
            if c.band is None:  # descriptive: the data is shown, no claim asks; it says why it has no band
                assert c.na_reason and c.na_reason.strip(), f"{where}: {c.test} needs a band (lo, hi) or, " \
                                                            "descriptive, an na_reason"
                continue
            assert not c.na_reason, f"{where}: na_reason on a claim with a band"
            assert len(c.band) == 2, f"{where}: band {c.band} is not (lo, hi)"
            lo, hi = c.band
            assert lo <= hi and not (math.isinf(lo) and math.isinf(hi)), f"{where}: band {c.band} bounds nothing"


@pytest.mark.parametrize("path", SPECS, ids=lambda p: p.name)
def test_notebook_computes_evidence_for_its_spec(path):
    notebook = _notebook_of(path)
    assert notebook.is_file(), f"{path.name} has no notebook {notebook.name} next to it"
    code = _code(notebook)
    assert path.name in code, f"{notebook.name} does not load its spec {path.name}"
    patterns = _string_patterns(code)
    spec = load_spec(path)
    missing = [c.id for c in spec.claims if c.test != "n/a" and not any(p.fullmatch(c.id) for p in patterns)]
    assert not missing, f"{notebook.name} names no evidence for {missing}"


def test_the_evidence_check_can_fail():
    """The static check above must see an id that is only in a comment as missing, an f-string with its
    study's prefix as a match, and one without a prefix as no match."""
    patterns = _string_patterns('# "x.y"\nevidence[f"reduce.bf16_{opt}"] = 1\nother = "a.b"\nf"{a}.{b}"')
    assert not any(p.fullmatch("x.y") for p in patterns)
    assert any(p.fullmatch("reduce.bf16_adamw") for p in patterns)
    assert any(p.fullmatch("a.b") for p in patterns)
    assert not any(p.fullmatch("reduce.other") for p in patterns)
    assert not any(p.fullmatch("any.thing") for p in patterns)


def test_the_muon_studys_ns_options_are_the_tuned_arm_with_one_iteration_fewer():
    """Issue 30's options in notebooks/13_muon_vs_adamw_claims.py: NS_BASELINE is what the tuned Muon arm runs
    (the config's defaults); each of NS_OPTIONS valid settings with one iteration fewer and another schedule
    (polar_express4) or AOL's start (aol4); each TOST at the spec's noise margin over the seeds GPU_SCALE gives
    the arm, the power line needing no more, its step cost descriptive; the runs counted with both arms."""
    from blunb.config import apply_overrides, preset

    spec = load_spec(REPO / "notebooks" / "13_muon_vs_adamw_claims.py")
    m, cfg = spec.module, preset(spec.gpu_scale["preset"])
    assert m.NS_BASELINE == {"muon_ns_schedule": cfg.muon_ns_schedule, "muon_ns_steps": cfg.muon_ns_steps}
    assert cfg.muon_ns_precondition == "none"
    expected = {"polar_express4": ("polar_express", "none"), "aol4": ("fixed", "aol")}
    assert set(m.NS_OPTIONS) == set(expected) == set(spec.gpu_scale["ns_options"])
    for tag, (schedule, start) in expected.items():
        option = apply_overrides(preset(spec.gpu_scale["preset"]), [f"{k}={v}" for k, v in m.NS_OPTIONS[tag].items()])
        option.validate()
        assert (option.muon_ns_schedule, option.muon_ns_steps, option.muon_ns_precondition) == (
            schedule, cfg.muon_ns_steps - 1, start)
        tost = spec.claim(f"muon.ns_{tag}_equivalent")
        assert (tost.test, tost.margin) == ("tost", m.NOISE_MARGIN_NATS)
        seeds = spec.gpu_scale["ns_options"][tag]["seeds"]
        assert tost.min_seeds == seeds == len(spec.gpu_scale["parameters"]["seeds"])
        assert all(2 <= n <= tost.min_seeds for n in spec.gpu_scale["power"].values())
        assert spec.claim(f"muon.ns_{tag}_step_cost").descriptive
    assert spec.gpu_scale["parameters"]["ns_option"] is True
    # the sweep 10, the tuned arms' other seeds 5 + 6, AdamW's 2x schedule 6, the controlled arms 3 + 3: 33
    runs = spec.gpu_scale["runs"]
    assert runs["grid"] == 33 + m.NS_OPTION_SEEDS * len(m.NS_OPTIONS)
    assert runs["step_cost"] == (2 + len(m.NS_OPTIONS)) * m.COST_ROUNDS   # AdamW, Muon and each option, every round
    assert runs["total"] == runs["grid"] + runs["step_cost"]
    # the step-cost claims count rounds (the spread between runs is in their interval), as many as the GPU runs make
    assert spec.gpu_scale["parameters"]["cost_rounds"] == spec.gpu_scale["step_cost"]["rounds"] == m.COST_ROUNDS >= 3
    for cid in ("muon.step_time_ratio", "muon.opt_step_extra"):
        assert spec.claim(cid).min_seeds == m.COST_ROUNDS


@pytest.mark.parametrize("spec_path", SPECS, ids=lambda p: p.stem)
def test_the_declared_gpu_parameters_are_the_notebooks_own(spec_path):
    """GPU_SCALE["parameters"] (where a spec declares the `-p` values of its GPU runs) names only parameters of
    its notebook, each of the type of the notebook's default: the declared command can run as declared."""
    from blunb.study import checked_parameters, notebook_defaults

    declared = load_spec(spec_path).gpu_scale.get("parameters")
    if declared is None:
        pytest.skip(f"{spec_path.name} declares no GPU parameters")
    assert checked_parameters(notebook_defaults(_notebook_of(spec_path)), declared) == declared
    scale = load_spec(spec_path).gpu_scale
    if "preset" in declared:   # a training study (overlap's GPU part is timelines; its runs stay tiny)
        assert declared["preset"] == scale["preset"] and declared["steps"] == scale["max_steps"]


def test_the_precision_gpu_parameters_realize_its_seeds():
    scale = load_spec(REPO / "notebooks" / "11_precision_claims.py").gpu_scale
    params = scale["parameters"]
    assert {len(params["seeds"]), len(params["fp8_seeds"])} == set(scale["seeds"].values())
    assert set(params["seeds"]) <= set(params["fp8_seeds"]) and params["runs_per_gpu"] == scale["runs_per_gpu"]
    assert f"global_batch={scale['tokens_per_step']}" in params["common"]
    assert f"warmup_steps={scale['warmup_steps']}" in params["common"]
    assert f"stable_steps={scale['stable_steps']}" in params["common"]
