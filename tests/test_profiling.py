"""The step profiler: kernel names binned into categories, tables per step, the trainer's profile_steps."""

import pandas as pd
import pytest
import torch

from blunb.config import ConfigError, preset
from blunb.profiling import categorize, profile_table
from blunb.train import train


@pytest.mark.parametrize("name, category", [
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", "matmul"),
    ("nvjet_tst_128x256_64x4_1x2_h_bz_coopA_TNT", "matmul"),
    ("aten::mm", "matmul"),
    ("_fwd_kernel", "attention"),
    ("pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits>", "attention"),
    ("_rms_norm_bwd", "rms_norm"),
    ("_qk_fwd", "qk_norm_rope"),
    ("_swiglu_fwd", "swiglu"),
    ("_ce_fwd", "cross_entropy"),
    ("void at::native::multi_tensor_apply_kernel<FusedAdamMathFunctor>", "optimizer"),
    ("_syrk_kernel", "syrk"),
    ("triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_0", "inductor_fused"),
    ("void at::native::unrolled_elementwise_kernel<direct_copy_kernel_cuda>", "copy_cast"),
    ("ncclDevKernel_ReduceScatter_Sum_bf16_RING_LL", "communication"),
    ("void at::native::vectorized_elementwise_kernel<4, CUDAFunctor_add<float>>", "elementwise"),
    ("some_unknown_kernel", "other"),
])
def test_kernel_names_fall_into_their_category(name, category):
    assert categorize(name) == category


def test_profile_table_counts_time_per_step():
    a, b = torch.randn(256, 256), torch.randn(256, 256)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(4):
            (a @ b).add_(1.0)
    categories, kernels = profile_table(prof, steps=4)
    assert {"matmul", "elementwise"} <= set(categories["category"])
    assert categories["share"].sum() == pytest.approx(1.0)
    mm = kernels[kernels["kernel"] == "aten::mm"].iloc[0]
    assert mm["calls_per_step"] == 1.0 and mm["ms_per_step"] > 0
    with pytest.raises(ValueError, match="steps must be >= 1"):
        profile_table(prof, steps=0)


def test_trainer_profiles_its_last_steps_and_times_the_optimizer(tmp_path):
    cfg = preset("tiny")
    cfg.max_steps, cfg.warmup_steps, cfg.stable_steps, cfg.profile_steps = 6, 1, 2, 2
    cfg.global_batch, cfg.val_freq, cfg.device = 2048, 100, "cpu"
    cfg.B, cfg.T = 4, 64
    train(cfg, tmp_path / "run")
    categories = pd.read_csv(tmp_path / "run" / "profile.csv")
    assert "matmul" in set(categories["category"]) and (categories["ms_per_step"] > 0).all()
    assert (tmp_path / "run" / "profile_kernels.csv").is_file()
    metrics = pd.read_csv(tmp_path / "run" / "metrics.csv")
    assert (metrics["opt_step_ms"] > 0).all() and (metrics["opt_step_ms"] < metrics["dt_ms"]).all()


def test_profile_steps_must_leave_steps_before_them():
    cfg = preset("tiny")
    cfg.profile_steps = cfg.max_steps - 1
    with pytest.raises(ConfigError, match="profile_steps must be >= 0 and < max_steps - 1"):
        cfg.validate()


@pytest.mark.parametrize("max_steps, val_freq, ckpt_freq, profile_steps, start_step, window", [
    (10, 100, 0, 3, 0, range(6, 9)),   # the steps before the last, whose validation stays out
    (10, 4, 0, 3, 0, range(6, 8)),     # cut at step 8's validation
    (10, 3, 0, 3, 0, range(6, 9)),     # step 6 validates before the profiler starts: kept
    (10, 100, 7, 3, 0, range(6, 7)),   # cut at step 7's checkpoint
    (10, 100, 0, 3, 8, range(8, 9)),   # resumed inside the window: what is left of it
    (10, 100, 0, 3, 9, range(9, 9)),   # resumed at the last step: nothing to profile
    (10, 100, 0, 0, 0, range(0)),      # off
])
def test_profile_window_holds_training_steps_only(max_steps, val_freq, ckpt_freq, profile_steps, start_step, window):
    from blunb.train import _profile_window

    cfg = preset("tiny")
    cfg.max_steps, cfg.val_freq, cfg.ckpt_freq, cfg.profile_steps = max_steps, val_freq, ckpt_freq, profile_steps
    assert list(_profile_window(cfg, start_step)) == list(window)


def test_device_side_spans_of_record_function_ranges_are_not_counted_twice():
    from types import SimpleNamespace

    cuda = torch.autograd.DeviceType.CUDA

    def event(key, us, annotation):
        return SimpleNamespace(key=key, self_device_time_total=us, count=1, device_type=cuda,
                               is_user_annotation=annotation)

    prof = SimpleNamespace(key_averages=lambda: [event("nvjet_sm90_tst_TNT", 900.0, False),
                                                 event("Optimizer.step#ShardedAdamW.step", 800.0, True),
                                                 event("multi_tensor_apply_kernel<FusedAdam>", 700.0, False)])
    categories, kernels = profile_table(prof, steps=1)
    assert list(kernels["kernel"]) == ["nvjet_sm90_tst_TNT", "multi_tensor_apply_kernel<FusedAdam>"]
    assert categories.set_index("category")["ms_per_step"].to_dict() == {"matmul": 0.9, "optimizer": 0.7}
