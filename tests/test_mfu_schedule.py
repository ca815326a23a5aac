import math

import pytest

from blunb.config import preset
from blunb.mfu import MFUMeter
from blunb.optim import wsd_lr


def test_mfu_counts_on_the_seed_config_by_hand():
    m = MFUMeter.build(preset("seed-4b").model, seq_len=4096, world_size=8, device_name="NVIDIA H200")
    # d3072 L36 Hq24 Hkv8 hd128 F8192 V50304 T4096, per token:
    qkv = 2 * 3072 * 3072 + 2 * 2 * 3072 * 1024            # 31,457,280
    proj = 2 * 3072 * 3072                                   # 18,874,368
    ffn = 2 * 3072 * 16384 + 2 * 8192 * 3072                 # 150,994,944
    attn_dense = 4 * 4096 * 128 * 24                         # 50,331,648
    head = 2 * 3072 * 50304                                  # 309,067,776
    assert m.fwd_per_token_causal == 36 * (qkv + proj + ffn + attn_dense // 2) + head == 8_462_794_752
    assert m.fwd_per_token_dense == 36 * (qkv + proj + ffn + attn_dense) + head
    assert m.flops_per_token_causal == 3 * m.fwd_per_token_causal
    assert m.flops_per_token_dense == 3 * m.fwd_per_token_dense
    assert m.peak_flops_per_gpu == 989.4e12
    tokens, dt = 2_097_152, 10.0
    assert m.mfu(dt, tokens) == pytest.approx(3 * 8_462_794_752 * tokens / (dt * 8 * 989.4e12))
    assert m.tflops_per_gpu(dt, tokens) == pytest.approx(m.mfu(dt, tokens) * 989.4)
    assert m.mfu_palm(dt, tokens) > m.mfu(dt, tokens)


def test_observe_drops_warmup_and_aggregates():
    m = MFUMeter.build(preset("tiny").model, seq_len=128, peak_tflops=1.0, warmup_steps=2)
    for dt in (100.0, 100.0, 1.0, 3.0):
        m.observe(dt, 1000)
    assert m.ss_steps == 2 and m.steady_tok_per_sec() == pytest.approx(2000 / 4.0)
    assert m.steady_mfu() == pytest.approx(m.flops_per_token_causal * 2000 / (4.0 * 1e12))
    assert m.best_mfu == pytest.approx(m.mfu(1.0, 1000))


def test_a_run_too_short_for_a_steady_figure_says_so_instead_of_zeros():
    m = MFUMeter.build(preset("tiny").model, seq_len=128, peak_tflops=1.0, warmup_steps=5)
    for _ in range(3):
        m.observe(0.5, 1000)
    text = m.summary()
    assert "too few steps for a steady figure" in text and "3 step(s) timed" in text
    assert "tok/s" not in text and "0.00%" not in text
    m.observe(0.5, 1000), m.observe(0.5, 1000), m.observe(0.5, 1000)
    assert "steady tok/s      : 2000" in m.summary()


def test_unknown_device_reports_na_and_override_wins(monkeypatch):
    monkeypatch.delenv("BLUNB_PEAK_TFLOPS", raising=False)
    cpu = MFUMeter.build(preset("tiny").model, seq_len=128, device_name="cpu")
    assert math.isnan(cpu.mfu(1.0, 100)) and "n/a" in cpu.banner(1000, 100)
    monkeypatch.setenv("BLUNB_PEAK_TFLOPS", "2.0")
    over = MFUMeter.build(preset("tiny").model, seq_len=128, device_name="cpu")
    assert over.peak_flops_per_gpu == 2.0e12 and over.mfu(1.0, 100) > 0


def test_wsd_values():
    args = dict(max_lr=1.0, min_lr=0.1, warmup=10, max_steps=100, stable=40)
    assert wsd_lr(0, **args) == pytest.approx(0.1)
    assert wsd_lr(9, **args) == pytest.approx(1.0)
    assert wsd_lr(10, **args) == 1.0 and wsd_lr(49, **args) == 1.0
    assert wsd_lr(50, **args) == pytest.approx(1.0)  # decay ratio 0
    mid = 50 + 49 / 2
    assert wsd_lr(int(mid), **args) == pytest.approx(0.1 + 0.45 * (1 + math.cos(math.pi * int(mid - 50) / 49)))
    assert wsd_lr(99, **args) == pytest.approx(0.1)  # the last step lands on min_lr


def test_wsd_errors():
    with pytest.raises(ValueError, match="no decay tail"):
        wsd_lr(0, 1.0, 0.1, warmup=50, max_steps=100, stable=50)
    with pytest.raises(ValueError, match="past the schedule"):
        wsd_lr(100, 1.0, 0.1, warmup=10, max_steps=100, stable=40)
