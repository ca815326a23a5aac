"""GPU: what the trainer's defaults pick on CUDA; its steady-state step issues no host-device sync
(steps 3..10), for every optimizer set and overlap switch; the one read of each step's scalars goes
through an event."""

from __future__ import annotations

import pandas as pd
import pytest
import torch

pytestmark = pytest.mark.gpu

CASES = {
    "adamw": [],
    "adamw-overlaps": ["overlap_backward=true", "overlap_refresh=true"],
    "adamw-globalclip": ["global_clip=true"],
    "muon": ["optimizer=muon"],
    "muon-overlaps": ["optimizer=muon", "overlap_backward=true", "overlap_refresh=true"],
    "ddp_adamw": ["optimizer=ddp_adamw"],
}


def test_the_defaults_pick_the_compiled_path_with_the_chunked_loss_on_cuda(tmp_path, monkeypatch):
    """No flags: on CUDA the trainer runs its fastest measured setting, compile and the chunked loss, and
    says so in its start lines; config.json records what ran."""
    import json

    from blunb.config import apply_overrides, preset
    from blunb.train import train

    monkeypatch.setenv("BLUNB_CACHE_DIR", str(tmp_path / "cache"))
    cfg = apply_overrides(preset("tiny"), ["device=cuda"])
    cfg.rescale_schedule(6)
    run_dir = train(cfg, tmp_path / "run")
    config = json.loads((run_dir / "config.json").read_text())
    assert config["compile"] is True and config["model"]["chunked_ce"] is True
    env = json.loads((run_dir / "env.json").read_text())
    assert env["device_uuid"] == str(torch.cuda.get_device_properties(0).uuid)   # which card, not just the model
    facts = env["training"]
    assert facts["auto_settings"] == {"compile": True, "model.chunked_ce": True}
    assert "(chunked, never materialized)" in facts["precision"]["logits"]
    assert "auto settings on cuda: compile=true model.chunked_ce=true (the fastest setting measured on CUDA" in \
        (run_dir / "log.txt").read_text()
    assert pd.read_csv(run_dir / "metrics.csv")["train_loss"].notna().all()


@pytest.mark.parametrize("case", list(CASES))
def test_steady_state_steps_never_sync(case, tmp_path, monkeypatch):
    import blunb.train as train_mod
    from blunb.config import apply_overrides, preset

    monkeypatch.setenv("BLUNB_CACHE_DIR", str(tmp_path / "cache"))
    cfg = apply_overrides(preset("tiny"), ["device=cuda", "val_freq=1000", *CASES[case]])
    cfg.rescale_schedule(14)
    cfg.val_freq = 1000   # validation (a deliberate sync) only at steps 0 and 13
    checked = []
    real_step = train_mod.train_step

    def strict_step(run, step, *args, **kw):
        # "error": any synchronizing call inside steps 3..10 raises, naming the call site.
        torch.cuda.set_sync_debug_mode("error" if 3 <= step <= 10 else "default")
        try:
            return real_step(run, step, *args, **kw)
        finally:
            torch.cuda.set_sync_debug_mode("default")
            checked.append(step)

    monkeypatch.setattr(train_mod, "train_step", strict_step)
    train_mod.train(cfg, tmp_path / "run")
    assert checked == list(range(14))
    m = pd.read_csv(tmp_path / "run" / "metrics.csv")
    assert list(m["step"]) == list(range(14)) and m["train_loss"].notna().all()
    assert m["train_loss"].iloc[-3:].mean() < m["train_loss"].iloc[:3].mean()
