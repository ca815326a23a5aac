"""The standard figures of a run or a study, drawn from metrics.csv frames."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files first; notebooks still display the returned figure
import matplotlib.pyplot as plt  # noqa: E402

from blunb.runs import Run  # noqa: E402


def plot_runs(runs: list[Run], out: str | Path | None = None):
    """2 x 3 panels: loss vs step, loss vs tokens, lr, grad norm, tok/s, MFU; one line per run."""
    fig, axes = plt.subplots(2, 3, figsize=(15, 8))
    (ax_loss, ax_tok, ax_lr), (ax_norm, ax_tps, ax_mfu) = axes
    for r in runs:
        m = r.metrics
        cfg = r.config
        tokens = (m["step"] + 1) * cfg["global_batch"]
        line, = ax_loss.plot(m["step"], m["train_loss"], label=f"{r.run_id} train", alpha=0.8)
        val = m.dropna(subset=["val_loss"])
        ax_loss.plot(val["step"], val["val_loss"], "o--", color=line.get_color(), label=f"{r.run_id} val")
        ax_tok.plot(tokens, m["train_loss"], color=line.get_color(), label=r.run_id)
        ax_lr.plot(m["step"], m["lr"], color=line.get_color(), label=r.run_id)
        ax_norm.plot(m["step"], m["grad_norm"], color=line.get_color(), label=r.run_id)
        ax_tps.plot(m["step"], m["tok_per_sec"], color=line.get_color(), label=r.run_id)
        if m["mfu"].notna().any():
            ax_mfu.plot(m["step"], 100 * m["mfu"], color=line.get_color(), label=r.run_id)
    if not any(r.metrics["mfu"].notna().any() for r in runs):
        ax_mfu.text(0.5, 0.5, "MFU n/a\n(no known peak FLOP/s for this device)", ha="center", va="center",
                    transform=ax_mfu.transAxes)
    titles = [("loss vs step", "step", "loss"), ("loss vs tokens", "tokens", "train loss"),
              ("learning rate", "step", "lr"), ("gradient norm", "step", "||g||"),
              ("throughput", "step", "tok/s"), ("MFU (causal count)", "step", "%")]
    for ax, (title, xl, yl) in zip(axes.flat, titles):
        ax.set(title=title, xlabel=xl, ylabel=yl)
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=7)
    fig.tight_layout()
    if out is not None:
        fig.savefig(out, dpi=110)
    return fig
