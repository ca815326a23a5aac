"""bench/muon.py's choice of what to time (the GPU timings themselves are not tested here): schedules at one
step count or each at its own, times the Newton-Schulz starts, and the refusals."""

import re

import pytest

from bench.muon import Variant, parse_args, parse_variants, reference_key


def test_the_old_schedule_form_runs_every_schedule_at_ns_steps():
    assert parse_variants("fixed,polar_express", 5) == [Variant("fixed", 5), Variant("polar_express", 5)]
    args, variants, presets = parse_args(["--schedules", "fixed", "--ns-steps", "4"])
    assert variants == [Variant("fixed", 4, "none")] and presets == [] and args.ns_steps == 4
    assert parse_args([])[1] == [Variant("fixed", 5, "none")]   # the defaults: what the bench timed before


def test_each_schedule_may_have_its_own_steps_and_every_one_runs_with_every_precondition():
    """One call times polar_express at 4 against fixed at 5, each from both starts (forms may mix)."""
    _, variants, _ = parse_args(["--schedules", "fixed:5,polar_express:4,fixed", "--ns-steps", "3",
                                 "--preconditions", "none,aol"])
    assert [v.label for v in variants] == ["NS5 fixed", "NS5 fixed+aol", "NS4 polar_express",
                                           "NS4 polar_express+aol", "NS3 fixed", "NS3 fixed+aol"]
    assert variants[1].columns() == {"ns_schedule": "fixed", "ns_steps": 5, "ns_precondition": "aol"}


def test_a_sharded_row_finds_its_one_gpu_row_by_case_and_setting():
    """The CSV gives strings back: a row as written (steps an int) and as read compare equal."""
    written = {"case": "1b body", **Variant("fixed", 4, "aol").columns()}
    read = {k: str(v) for k, v in written.items()}
    assert reference_key(written) == reference_key(read)
    assert reference_key(written) != reference_key({**written, "ns_precondition": "none"})


@pytest.mark.parametrize("argv, message", [
    (["--schedules", "polar"], "unknown schedule 'polar'"),
    (["--schedules", "fixed:four"], "'fixed:four' is not name or name:steps"),
    (["--schedules", "fixed:0"], "steps must be >= 1"),
    (["--schedules", ","], "at least one entry"),
    (["--preconditions", "none,turbo"], "--preconditions: unknown 'turbo' .known: none, aol."),
    (["--schedules", "fixed:5,fixed", "--ns-steps", "5"], "repeat a setting"),
    (["--ns-steps", "0"], "--ns-steps must be >= 1"),
    (["--presets", "2b"], "--presets takes"),
])
def test_bad_arguments_are_refused_by_name(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        parse_args(argv)
    assert exc.value.code == 2
    assert re.search(message, capsys.readouterr().err)
