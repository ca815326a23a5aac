"""bench/speed.py's ratios (the GPU runs themselves are not tested here): every row against the same call's
plain_compile, the plain_compile of its own fp8 recipe and blunb's bf16 `adamw` row, per preset."""

import math

import pytest

from bench.speed import _with_ratios


def test_each_row_is_measured_against_the_baselines_of_its_own_preset_and_fp8():
    def row(preset, variant, fp8, tok, mem, status="ok"):
        return {"preset": preset, "variant": variant, "fp8": fp8, "status": status, "tok_per_s": tok,
                "peak_mem_gib": mem}

    table = _with_ratios([
        row("1b", "plain_compile", "off", 100.0, 10.0),
        row("1b", "plain_compile-fp8-rowwise", "rowwise", 150.0, 9.0),
        row("1b", "plain_eager-fp8-rowwise", "rowwise", 80.0, 12.0),
        row("1b", "adamw", "off", 110.0, 10.5),
        row("1b", "adamw-fp8-rowwise", "rowwise", 165.0, 9.9),
        row("1b", "adamw-fp8-tensorwise", "tensorwise", float("nan"), float("nan"), status="failed (1)"),
        row("seed-4b", "plain_compile", "off", 20.0, 80.0),
        row("seed-4b", "adamw", "off", 25.0, 70.0),
    ]).set_index(["preset", "variant"])
    fp8_row = table.loc[("1b", "adamw-fp8-rowwise")]
    assert fp8_row["tok_per_s_vs_plain_compile_same_fp8"] == pytest.approx(165 / 150)
    assert fp8_row["mem_vs_plain_compile_same_fp8"] == pytest.approx(9.9 / 9.0)
    assert fp8_row["tok_per_s_vs_plain_compile"] == pytest.approx(1.65)
    assert fp8_row["tok_per_s_vs_blunb_bf16"] == pytest.approx(1.5)
    assert table.loc[("1b", "adamw"), "tok_per_s_vs_plain_compile_same_fp8"] == pytest.approx(1.1)
    eager = table.loc[("1b", "plain_eager-fp8-rowwise")]
    assert eager["tok_per_s_vs_plain_compile_same_fp8"] == pytest.approx(80 / 150)
    assert table.loc[("seed-4b", "adamw"), "tok_per_s_vs_blunb_bf16"] == 1.0   # its own preset's, not 1b's
    assert table.loc[("seed-4b", "adamw"), "tok_per_s_vs_plain_compile"] == pytest.approx(1.25)
    # no tensorwise baseline in this call, and the row failed: no ratio rather than a wrong one
    assert math.isnan(table.loc[("1b", "adamw-fp8-tensorwise"), "tok_per_s_vs_plain_compile_same_fp8"])


def test_rows_are_measured_against_the_whole_step_graph_baseline_where_the_call_ran_it():
    table = _with_ratios([{"preset": p, "variant": v, "status": "ok", "tok_per_s": t, "peak_mem_gib": 1.0}
                          for p, v, t in [("124m", "plain_compile", 100.0), ("124m", "plain_compile_graph", 125.0),
                                          ("124m", "adamw-graph", 150.0), ("1b", "plain_compile", 10.0),
                                          ("1b", "adamw-graph", 11.0)]]).set_index(["preset", "variant"])
    assert table.loc[("124m", "adamw-graph"), "tok_per_s_vs_plain_compile_graph"] == pytest.approx(1.2)
    assert table.loc[("124m", "plain_compile"), "tok_per_s_vs_plain_compile_graph"] == pytest.approx(0.8)
    assert math.isnan(table.loc[("1b", "adamw-graph"), "tok_per_s_vs_plain_compile_graph"])   # none ran for 1b


def test_rows_from_before_the_fp8_column_read_as_off():
    table = _with_ratios([{"preset": "1b", "variant": "plain_compile", "status": "ok", "tok_per_s": 100.0,
                           "peak_mem_gib": 10.0},
                          {"preset": "1b", "variant": "adamw", "status": "ok", "tok_per_s": 105.0,
                           "peak_mem_gib": 11.0}])
    assert list(table["fp8"]) == ["off", "off"]
    assert table["tok_per_s_vs_plain_compile_same_fp8"].tolist() == pytest.approx([1.0, 1.05])


def test_blunb_rows_ask_for_a_validation_the_random_token_shards_hold(monkeypatch, tmp_path):
    """seed-4b's rows failed on an H200 (2026-12-07): the trainer's default val_tokens asked the val shards for 320
    windows of T = 4096 where they hold 98. Every row now asks for four micro-batches; a variant's own value wins."""
    import bench.speed as speed

    seen = []
    monkeypatch.setattr(speed, "run_trainer_variant",
                        lambda preset, name, overrides, **kw: seen.append(overrides) or {"status": "failed (2)"})
    speed._blunb_row("seed-4b", "adamw", ["optimizer=adamw"], 10, 4, 0, tmp_path)
    speed._blunb_row("seed-4b", "mine", ["val_tokens=8192"], 10, 4, 0, tmp_path)
    assert "val_tokens=32768" in seen[0] and seen[0][-1] == "optimizer=adamw"   # 4 x B2 x T4096: 8 windows
    assert seen[1].index("val_tokens=32768") < seen[1].index("val_tokens=8192")  # later overrides win


def test_a_blunb_row_brings_its_profile_categories_and_top_kernels(tmp_path):
    """A real tiny run on the CPU, profiled for one step: the row's categories and its largest ops by name
    (what bench/speed.py writes to <out>_profile.csv and <out>_profile_kernels.csv), both labelled with the row,
    the kernels' time adding up to no more than the categories'."""
    import bench.speed as speed

    row, (categories, kernels) = speed._blunb_row("tiny", "adamw", ["optimizer=adamw"], 3, 1, 1, tmp_path)
    assert row["status"] == "ok", row
    assert categories and kernels
    assert {(r["preset"], r["variant"]) for r in categories + kernels} == {("tiny", "adamw")}
    assert {"kernel", "category", "ms_per_step"} <= set(kernels[0])
    assert sum(r["ms_per_step"] for r in kernels) <= sum(r["ms_per_step"] for r in categories) * (1 + 1e-9)
