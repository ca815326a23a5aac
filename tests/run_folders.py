"""Stand-in run folders for the study runner's tests: what a finished run leaves, without training it."""

from pathlib import Path

from blunb.runs import write_status


def write_completed(run_dir: str | Path, steps: int) -> None:
    """A completed status over a metrics.csv that reaches the last step, as the trainer leaves them (the runner
    refuses a completed run whose metrics stop short)."""
    run_dir = Path(run_dir)
    rows = "".join(f"{step},{1.0 / (step + 1):.4f},{'1.0' if step == steps - 1 else ''},1000,10,0.1\n"
                   for step in range(steps))
    (run_dir / "metrics.csv").write_text("step,train_loss,val_loss,tok_per_sec,dt_ms,mfu\n" + rows)
    write_status(run_dir, "completed", steps, steps)
