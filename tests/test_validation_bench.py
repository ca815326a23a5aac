"""bench/validation.py on the CPU (its GPU timings are not tested here): the variants time the same
model, and evaluate() and the device-batch loop read the same tokens (one loss); bad input is refused."""

import pandas as pd
import pytest

from bench import validation


def test_the_validation_bench_times_a_step_and_both_passes_over_the_same_tokens(tmp_path):
    out = tmp_path / "validation.csv"
    validation.main(["--preset", "tiny", "--steps", "1", "--passes", "1", "--val-tokens", "2000",
                     "--out", str(out)])
    table = pd.read_csv(out)
    assert table["variant"].tolist() == ["train_step", "evaluate_first_pass", "evaluate",
                                          "eval_device_batches"]
    assert (table["tok_per_s"] > 0).all() and table["vs_train_step"].iloc[0] == 1.0
    assert table.loc[2, "loss"] == pytest.approx(table.loc[3, "loss"], rel=1e-6)   # the same 15 windows of T 128
    assert (table["val_tokens"] == 2000).all() and (table["device"] == "cpu").all()
    assert not (tmp_path / "validation_profile.csv").exists()   # --profile: CUDA only


@pytest.mark.parametrize("argv, message", [
    (["--steps", "0"], "--steps and --passes must be >= 1"),
    (["--val-tokens", "100"], "--val-tokens must hold one window of T = 128 tokens"),
])
def test_the_validation_bench_refuses_bad_input(tmp_path, capsys, argv, message):
    with pytest.raises(SystemExit):
        validation.main(["--preset", "tiny", *argv, "--out", str(tmp_path / "v.csv")])
    assert message in capsys.readouterr().err
    assert not (tmp_path / "v.csv").exists()
