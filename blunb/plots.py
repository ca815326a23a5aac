"""The standard figures of a run or a study, drawn from metrics.csv frames.

Backend: inside IPython / Jupyter the session's own one is kept (a notebook's inline backend puts
each figure in its cell's outputs, so an executed notebook carries it as an image); a plain script
draws off-screen (Agg), so it needs no display. MPLBACKEND, where set, wins everywhere.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

import matplotlib


def _in_ipython() -> bool:
    ipython = sys.modules.get("IPython")
    return ipython is not None and ipython.get_ipython() is not None


if not os.environ.get("MPLBACKEND") and not _in_ipython():
    matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from blunb.runs import Run  # noqa: E402

log = logging.getLogger(__name__)

MFU_NOTE = "MFU left out: n/a for every run\n(no known peak FLOP/s for this device;\nBLUNB_PEAK_TFLOPS supplies one)"


def _distinct(values) -> str:
    return ", ".join(dict.fromkeys(str(v) for v in values))


def figure_title(runs: list[Run]) -> str:
    """What the runs trained: preset, optimizer and world size (each distinct value once)."""
    return (f"preset {_distinct(r.config.get('preset') for r in runs)} | "
            f"optimizer {_distinct(r.config.get('optimizer') for r in runs)} | "
            f"world size {_distinct(r.env.get('world_size') for r in runs)}")


def plot_runs(runs: list[Run], out: str | Path | None = None):
    """2 x 3 panels, one line per run: loss vs step and vs tokens (nats), learning rate(s), gradient
    norm, throughput, MFU. The MFU panel is left out, with a note in its place, when no run has an
    MFU (the CPU). `out`: also write the figure to `out` as .png and .svg (its suffix is replaced).
    In a notebook the figure shows in the cell's output (end the cell with an assignment, not with
    the figure itself, or it shows twice)."""
    fig, axes = plt.subplots(2, 3, figsize=(15, 8))
    (ax_loss, ax_tok, ax_lr), (ax_norm, ax_tps, ax_mfu) = axes
    has_mfu = any(r.metrics["mfu"].notna().any() for r in runs)
    for r in runs:
        m = r.metrics
        tokens = m["tokens"] if "tokens" in m else (m["step"] + 1) * r.config["global_batch"]
        line, = ax_loss.plot(m["step"], m["train_loss"], label=f"{r.run_id} train", alpha=0.8)
        color = line.get_color()
        val = m.dropna(subset=["val_loss"])
        ax_loss.plot(val["step"], val["val_loss"], "o--", color=color, label=f"{r.run_id} val")
        ax_tok.plot(tokens, m["train_loss"], color=color, label=r.run_id)
        # Muon runs have two schedules: the AdamW groups' lr and the Muon matrices' lr_muon.
        muon = "lr_muon" in m and m["lr_muon"].notna().any()
        ax_lr.plot(m["step"], m["lr"], color=color, label=f"{r.run_id} lr" if muon else r.run_id)
        if muon:
            ax_lr.plot(m["step"], m["lr_muon"], "--", color=color, label=f"{r.run_id} lr_muon")
        ax_norm.plot(m["step"], m["grad_norm"], color=color, label=r.run_id)
        ax_tps.plot(m["step"], m["tok_per_sec"], color=color, label=r.run_id)
        if has_mfu:
            ax_mfu.plot(m["step"], 100 * m["mfu"], color=color, label=r.run_id)
    titles = [("loss vs step", "step", "loss (nats)"), ("loss vs tokens", "tokens", "train loss (nats)"),
              ("learning rate", "step", "lr"), ("gradient norm", "step", "||g||"),
              ("throughput", "step", "tok/s"), ("MFU (causal count)", "step", "%")]
    for ax, (title, xl, yl) in zip(axes.flat, titles):
        ax.set(title=title, xlabel=xl, ylabel=yl)
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=7)
    if not has_mfu:
        ax_mfu.set_axis_off()
        ax_mfu.set_title("")
        ax_mfu.text(0.5, 0.5, MFU_NOTE, ha="center", va="center", transform=ax_mfu.transAxes)
    fig.suptitle(figure_title(runs))
    fig.tight_layout()
    if out is not None:
        for suffix in (".png", ".svg"):
            path = Path(out).with_suffix(suffix)
            fig.savefig(path, dpi=110)
            log.info("wrote %s", path)
    return fig
