"""The README's speed table, rendered from the committed bench/speed.py CSVs (never typed by hand).

    python bench/speed_table.py           # rewrite the table between README.md's speed-table markers
    python bench/speed_table.py --check   # exit 1, saying so, where README.md's table is not the CSVs' render

One row per measured variant of each source CSV: ms per step, tok/s, MFU (causal), peak memory and the
ratios to the same call's plain baselines (plain torch.compile, and plain compile with the whole step in
one CUDA graph where that call ran it), with the call's commit and date. SOURCES lists the calls shown.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pandas as pd

REPO = Path(__file__).resolve().parents[1]
# The calls the README shows, newest first within a preset: each one holds its own baselines.
SOURCES = ["results/bench/speed_graph_124m_f66300f.csv", "results/bench/speed_graph_1b_f66300f.csv",
           "results/bench/speed_graph_seed4b_f66300f.csv", "results/bench/speed_fp8_1b_f66300f.csv",
           "results/bench/speed_1b.csv", "results/bench/speed_124m_706a0fd.csv",
           "results/bench/speed_1b_batch524k.csv", "results/bench/speed_graph_1b_8c2c5d0.csv",
           "results/bench/speed_graph_124m_8c2c5d0.csv"]
START, END = "<!-- speed-table: start (bench/speed_table.py writes it) -->", "<!-- speed-table: end -->"
# peak GiB: the timed steps' own peak (graph rows measured at a commit before 4bb5f98 leave out the graph's pool,
# which the capture allocates before them; later ones count the capture's peak); run peak GiB: the whole blunb
# run's, graph pool and compile included (blunb rows only).
HEADER = ("| preset | variant | device | ms/step | tok/s | MFU causal | peak GiB | run peak GiB | vs plain compile "
          "| vs plain compile + graph | commit, date | file |\n|---|---|---|---|---|---|---|---|---|---|---|---|")


def _number(value, fmt: str) -> str:
    return "" if pd.isna(value) else format(value, fmt)


def render(sources: list[str], root: Path = REPO) -> str:
    """The markdown table of every ok row of `sources` (paths relative to `root`), in file order."""
    lines = [HEADER]
    for source in sources:
        table = pd.read_csv(root / source)
        missing = {"preset", "variant", "ms_per_step", "tok_per_s"} - set(table.columns)
        if missing:
            raise ValueError(f"{source} is not a bench/speed.py CSV: it has no {', '.join(sorted(missing))} column")
        if "status" in table:
            table = table[table["status"] == "ok"]
        for row in table.to_dict("records"):
            when = ", ".join(str(row[k])[:n] for k, n in (("git_sha", 7), ("date", 10)) if not pd.isna(row.get(k)))
            device = "" if pd.isna(row.get("device")) else str(row["device"]).removeprefix("NVIDIA ")
            lines.append("| " + " | ".join([
                str(row["preset"]), str(row["variant"]), device, _number(row["ms_per_step"], ".1f"),
                _number(row["tok_per_s"], ",.0f"), _number(row.get("mfu_causal"), ".1%"),
                _number(row.get("peak_mem_gib"), ".2f"), _number(row.get("run_peak_mem_gib"), ".2f"),
                _number(row.get("tok_per_s_vs_plain_compile"), ".3f"),
                _number(row.get("tok_per_s_vs_plain_compile_graph"), ".3f"), when, f"`{Path(source).name}`"]) + " |")
    return "\n".join(lines)


def replace_block(text: str, table: str) -> str:
    """`text` with the lines between the markers replaced by `table`; ValueError without exactly one pair."""
    if text.count(START) != 1 or text.count(END) != 1 or text.index(START) > text.index(END):
        raise ValueError(f"README.md must hold the line {START!r} once, and {END!r} once after it")
    head, rest = text.split(START)
    return f"{head}{START}\n{table}\n{END}{rest.split(END, 1)[1]}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--check", action="store_true", help="only compare; exit 1 where the README's table is stale")
    ap.add_argument("--readme", type=Path, default=REPO / "README.md")
    args = ap.parse_args()
    text = args.readme.read_text()
    updated = replace_block(text, render(SOURCES))
    if args.check:
        if updated != text:
            sys.exit(f"{args.readme}: the speed table differs from its CSVs; run python bench/speed_table.py")
        return
    args.readme.write_text(updated)


if __name__ == "__main__":
    main()
