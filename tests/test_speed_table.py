"""bench/speed_table.py: the README's speed table is the render of its CSVs, and bad input is refused."""

import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from bench.speed_table import END, START, render, replace_block

REPO = Path(__file__).resolve().parents[1]


def test_readme_speed_table_is_current():
    proc = subprocess.run([sys.executable, "bench/speed_table.py", "--check"], cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_render_reads_each_ok_row_with_its_ratios(tmp_path):
    pd.DataFrame([
        {"preset": "1b", "variant": "plain_compile", "status": "ok", "ms_per_step": 180.0, "tok_per_s": 91022.2,
         "mfu_causal": 0.5, "peak_mem_gib": 34.0, "tok_per_s_vs_plain_compile": 1.0,
         "tok_per_s_vs_plain_compile_graph": 0.857, "git_sha": "abcdef0123", "date": "2026-12-05T10:00:00Z",
         "device": "NVIDIA H200", "run_peak_mem_gib": 35.5},
        {"preset": "1b", "variant": "adamw-graph", "status": "failed", "ms_per_step": None, "tok_per_s": None},
    ]).to_csv(tmp_path / "s.csv", index=False)
    lines = render(["s.csv"], root=tmp_path).splitlines()
    assert len(lines) == 3   # header, separator, the one ok row
    assert lines[2] == ("| 1b | plain_compile | H200 | 180.0 | 91,022 | 50.0% | 34.00 | 35.50 | 1.000 | 0.857 | "
                        "abcdef0, 2026-12-05 | `s.csv` |")


def test_a_csv_without_the_speed_columns_is_refused(tmp_path):
    pd.DataFrame([{"preset": "1b", "ms": 1.0}]).to_csv(tmp_path / "other.csv", index=False)
    with pytest.raises(ValueError, match="not a bench/speed.py CSV"):
        render(["other.csv"], root=tmp_path)


def test_replace_block_needs_one_pair_of_markers():
    text = f"a\n{START}\nold\n{END}\nb\n"
    assert replace_block(text, "new") == f"a\n{START}\nnew\n{END}\nb\n"
    for broken in ("a\nb\n", f"{END}\n{START}\n", f"{START}\n{START}\n{END}\n"):
        with pytest.raises(ValueError, match="must hold the line"):
            replace_block(broken, "new")
