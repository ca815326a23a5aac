"""Declared claims: each study's spec file states, before its runs, what it tests and how it can fail.

A claim is declared with the criterion that decides it (notebooks/<study>_claims.py, committed before
the GPU runs), so a verdict cannot be fitted to the results afterwards: the notebook only computes one
`Evidence` per claim from its run folders, and `evaluate(spec, evidence)` applies the declared rules,
one row per claim, into claims.csv. The rules are conservative by design: a wide interval never passes,
and a criterion is never read off the arms' own spread.

Details (the spec file, an example, the verdict rules): docs/architecture.md, section "blunb/claims.py".
"""

from __future__ import annotations

import importlib.util
import math
import types
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd

from blunb.stats import Interval, MeanCI, Tost

TESTS = ("tost", "diff_ci", "ratio_ci", "band", "exact", "n/a")
RESULTS = ("pass", "fail", "inconclusive", "too few seeds", "n/a")
COLUMNS = ["id", "source", "figure", "statistic", "estimate", "ci_lo", "ci_hi", "n", "test", "margin_or_band",
           "alpha", "result", "verdict", "detail"]


class SpecError(ValueError):
    """A spec that cannot be evaluated as written: a bad claim, missing or unknown evidence."""


@dataclass(frozen=True)
class Claim:
    id: str                 # short, stable: "clip.adamw_ab_equivalent"
    source: str             # the reference's statement, in a few words
    figure: str             # where the reference says it (figure / table / section of the seed's text)
    statistic: str          # what blunb computes, in words
    test: str               # TESTS
    margin: float | None = None               # tost: the equivalence margin, stated before the runs
    band: tuple[float, float] | None = None   # band / ratio_ci / diff_ci / exact: where it must lie
    alpha: float = 0.05
    min_seeds: int = 1
    na_reason: str | None = None              # n/a: why this setup cannot test it; descriptive: why no band

    def __post_init__(self):
        def bad(why: str):
            raise SpecError(f"claim {self.id!r}: {why}")
        if not self.id or not all(isinstance(getattr(self, k), str) and getattr(self, k).strip()
                                  for k in ("source", "figure", "statistic")):
            bad("id, source, figure and statistic must all be non-empty text")
        if self.test not in TESTS:
            bad(f"test must be one of {TESTS}, got {self.test!r}")
        if not 0 < self.alpha < 0.5:
            bad(f"alpha must be in (0, 0.5), got {self.alpha}")
        if isinstance(self.min_seeds, bool) or not isinstance(self.min_seeds, int) or self.min_seeds < 1:
            bad(f"min_seeds must be an integer >= 1, got {self.min_seeds!r}")
        if self.test == "n/a":
            if not self.na_reason:
                bad("an n/a claim needs its na_reason")
            if self.margin is not None or self.band is not None:
                bad("an n/a claim has no margin or band")
            return
        if self.test == "tost":
            if self.margin is None or not (math.isfinite(self.margin) and self.margin > 0):
                bad(f"a tost needs a finite margin > 0, got {self.margin!r}")
            if self.band is not None:
                bad("a tost has a margin, not a band")
            return
        if self.margin is not None:
            bad(f"a {self.test} test has a band, not a margin")
        if self.band is None:
            if not self.na_reason:
                bad(f"a {self.test} test needs a band (or, descriptive, an na_reason saying why it has none)")
            return
        lo, hi = self.band
        if math.isnan(lo) or math.isnan(hi) or lo > hi or (math.isinf(lo) and math.isinf(hi)):
            bad(f"band must be (lo, hi) with lo <= hi and at most one side infinite, got {self.band!r}")

    @property
    def descriptive(self) -> bool:
        """A reported statistic with no criterion (the data shows it; no claim asks)."""
        return self.test != "n/a" and self.test != "tost" and self.band is None

    @property
    def confidence(self) -> float:
        """The interval the evidence should carry: 1 - 2*alpha for a tost (its two one-sided tests)
        and for a one-sided band (its finite edge is then the one-sided 1 - alpha bound), else 1 - alpha."""
        one_sided = self.band is not None and (math.isinf(self.band[0]) or math.isinf(self.band[1]))
        return 1 - 2 * self.alpha if self.test == "tost" or one_sided else 1 - self.alpha

    def criterion(self) -> str:
        if self.test == "tost":
            return f"+-{self.margin:g}"
        if self.band is None:
            return ""
        lo, hi = self.band
        return f"[{lo:g}, {hi:g}]"


@dataclass(frozen=True)
class Evidence:
    """What a notebook computes for one claim."""

    estimate: float
    lo: float | None = None   # the interval (a tost's 1 - 2*alpha one); None for an exact statistic
    hi: float | None = None
    n: int = 1                # seeds / pairs behind it
    detail: str = ""          # the human-readable numbers for the table
    na_reason: str | None = None  # this run cannot measure it (e.g. CUDA memory on the CPU): result n/a

    @classmethod
    def of(cls, stat, detail: str = "") -> "Evidence":
        """From blunb.stats' results: Interval, Tost or MeanCI."""
        if isinstance(stat, (Interval, Tost)):
            return cls(float(stat.estimate), float(stat.lo), float(stat.hi), int(stat.n), detail)
        if isinstance(stat, MeanCI):
            return cls(float(stat.mean), float(stat.low), float(stat.high), int(stat.n), detail)
        raise TypeError(f"Evidence.of takes an Interval, Tost or MeanCI, got {type(stat).__name__}")


@dataclass(frozen=True)
class Spec:
    path: Path
    claims: tuple[Claim, ...]
    gpu_scale: dict
    module: types.ModuleType = field(repr=False)  # the spec file itself: its constants (spec.module.TARGET)

    @property
    def CLAIMS(self) -> list[Claim]:  # noqa: N802 (the spec file's own names, for reading it like the module)
        return list(self.claims)

    @property
    def GPU_SCALE(self) -> dict:  # noqa: N802
        return self.gpu_scale

    def claim(self, claim_id: str) -> Claim:
        for c in self.claims:
            if c.id == claim_id:
                return c
        raise SpecError(f"{self.path.name} declares no claim {claim_id!r}")


def load_spec(path) -> Spec:
    """Import a spec file by path (the notebooks' spec files are not a package) and check it."""
    path = Path(path).resolve()
    if not path.is_file():
        raise SpecError(f"no spec file at {path}")
    module_spec = importlib.util.spec_from_file_location(f"blunb_claims_spec_{path.stem}", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    claims = getattr(module, "CLAIMS", None)
    if not isinstance(claims, list) or not claims or not all(isinstance(c, Claim) for c in claims):
        raise SpecError(f"{path.name} must define CLAIMS, a non-empty list of blunb.claims.Claim")
    ids = [c.id for c in claims]
    dup = sorted({i for i in ids if ids.count(i) > 1})
    if dup:
        raise SpecError(f"{path.name}: claim ids must be unique; repeated: {dup}")
    gpu_scale = getattr(module, "GPU_SCALE", None)
    if not isinstance(gpu_scale, dict) or not gpu_scale:
        raise SpecError(f"{path.name} must define GPU_SCALE, a dict saying what the GPU runs will be")
    return Spec(path, tuple(claims), dict(gpu_scale), module)


def _inside(lo: float, hi: float, band: tuple[float, float]) -> bool:
    return band[0] <= lo and hi <= band[1]


def _disjoint(lo: float, hi: float, band: tuple[float, float]) -> bool:
    return hi < band[0] or lo > band[1]


def _result(claim: Claim, ev: Evidence) -> str:
    if claim.test == "n/a" or claim.descriptive or ev.na_reason:
        return "n/a"
    if ev.n < claim.min_seeds:
        return "too few seeds"
    if math.isnan(ev.estimate):
        return "inconclusive"  # nothing was measured
    if claim.test == "exact":
        return "pass" if claim.band[0] <= ev.estimate <= claim.band[1] else "fail"
    if ev.lo is None or ev.hi is None:
        raise SpecError(f"claim {claim.id!r}: a {claim.test} test needs an interval (Evidence lo and hi)")
    if math.isnan(ev.lo) or math.isnan(ev.hi):
        return "inconclusive"  # no interval (one seed): nothing is shown
    band = (-claim.margin, claim.margin) if claim.test == "tost" else claim.band
    if _inside(ev.lo, ev.hi, band):
        return "pass"
    return "fail" if _disjoint(ev.lo, ev.hi, band) else "inconclusive"


def evaluate(spec: Spec, evidence: dict[str, Evidence]) -> pd.DataFrame:
    """The claims table: one row per declared claim, in the spec's order (columns COLUMNS).

    Every claim but an n/a one must have its evidence; evidence for an id the spec does not declare
    is an error too (a typo would otherwise drop a claim silently)."""
    unknown = sorted(set(evidence) - {c.id for c in spec.claims})
    if unknown:
        raise SpecError(f"evidence for claims {spec.path.name} does not declare: {unknown}")
    missing = [c.id for c in spec.claims if c.test != "n/a" and c.id not in evidence]
    if missing:
        raise SpecError(f"no evidence for the declared claims {missing}: every claim is evaluated or n/a")
    rows = []
    for c in spec.claims:
        ev = evidence.get(c.id)
        if ev is not None and not isinstance(ev, Evidence):
            raise SpecError(f"claim {c.id!r}: evidence must be a blunb.claims.Evidence, got {type(ev).__name__}")
        result = _result(c, ev) if ev is not None else "n/a"
        verdict = "n/a" if result == "n/a" else result == "pass"
        if c.test == "n/a":
            why = f"n/a: {c.na_reason}"
        elif c.descriptive:
            why = f"descriptive: {c.na_reason}"
        else:
            why = f"n/a: {ev.na_reason}" if ev.na_reason else ""
        detail = "; ".join(x for x in (ev.detail if ev is not None else "", why) if x)
        nan = float("nan")
        rows.append({"id": c.id, "source": c.source, "figure": c.figure, "statistic": c.statistic,
                     "estimate": ev.estimate if ev is not None else nan,
                     "ci_lo": ev.lo if ev is not None and ev.lo is not None else nan,
                     "ci_hi": ev.hi if ev is not None and ev.hi is not None else nan,
                     "n": ev.n if ev is not None else 0, "test": c.test, "margin_or_band": c.criterion(),
                     "alpha": c.alpha, "result": result, "verdict": verdict, "detail": detail})
    return pd.DataFrame(rows, columns=COLUMNS)
