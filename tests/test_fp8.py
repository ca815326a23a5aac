"""model.fp8 (blunb/fp8.py): the setting, its refusals before any work, old run folders, and, where torchao is
importable (it is not in CI: the optional fp8 extra), the conversion of exactly the body's Linears and the float8
rounding of one converted Linear. The GPU half is tests/test_fp8_gpu.py."""

from __future__ import annotations

import json
import math
import sys

import pytest
import torch
import torch.nn as nn

from blunb import fp8
from blunb.config import (
    FP8_RECIPES,
    PRESETS,
    ConfigError,
    TrainConfig,
    apply_overrides,
    predated_defaults,
    preset,
    settings_help,
)
from tests.distributed import REPO

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib


@pytest.fixture
def no_torchao(monkeypatch):
    """import torchao fails, as where it is not installed (also where it is)."""
    for name in [m for m in sys.modules if m == "torchao" or m.startswith("torchao.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "torchao", None)


# ---------------------------------------------------------------- the setting


def test_fp8_is_off_by_default_and_set_like_the_other_precision_fields():
    assert all(preset(name).model.fp8 == "off" for name in PRESETS)
    for key in ("model.fp8", "fp8"):
        for recipe in FP8_RECIPES:
            cfg = apply_overrides(preset("tiny"), [f"{key}={recipe}"])
            assert cfg.model.fp8 == recipe and cfg.to_dict()["model"]["fp8"] == recipe
    assert "model.fp8 = 'off'" in settings_help(preset("tiny"))


@pytest.mark.parametrize("name", list(PRESETS))
def test_every_preset_validates_with_each_recipe(name):
    """Their shapes are float8-aligned: the bench's 1b and seed-4b rows are not refused."""
    for recipe in FP8_RECIPES:
        apply_overrides(preset(name), [f"model.fp8={recipe}"]).validate(world_size=1)


@pytest.mark.parametrize("value", ["e4m3", "true", "on", "Rowwise"])
def test_an_unknown_value_is_refused_naming_the_choices(value):
    with pytest.raises(ConfigError, match=r"model.fp8 must be off or one of \('tensorwise', 'rowwise'\), got"):
        apply_overrides(preset("tiny"), [f"model.fp8={value}"]).validate()


@pytest.mark.parametrize("overrides, named", [
    (["d_model=136"], "d_model = 136"),
    (["ffn_hidden=360"], "ffn_hidden = 360"),
    (["head_dim=36"], "kv_heads\\*head_dim = 72"),          # q_heads*head_dim = 144 is aligned
    (["B=1", "T=24", "global_batch=24"], "B\\*T = 1\\*24 = 24"),
])
def test_a_dimension_float8_gemms_cannot_take_is_refused_by_name(overrides, named):
    apply_overrides(preset("tiny"), overrides).validate()  # fine without fp8: the refusal is fp8's
    with pytest.raises(ConfigError, match=f"model.fp8=rowwise: .*divisible by 16, got {named}"):
        apply_overrides(preset("tiny"), [*overrides, "model.fp8=rowwise"]).validate()


def test_a_run_folder_from_before_the_field_reads_as_off():
    old = json.loads((REPO / "results" / "precision" / "all_bf16-s0" / "config.json").read_text())
    assert "fp8" not in old["model"]   # a committed run made before model.fp8 existed
    assert TrainConfig.from_dict(old).model.fp8 == "off"
    assert predated_defaults()["model"]["fp8"] == "off"   # what the study cache fills in for it


def test_the_fp8_extra_pins_the_torchao_the_messages_name_and_ci_does_not_install_it():
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert extras["fp8"] == [fp8.TORCHAO]
    assert not any("torchao" in req for name, reqs in extras.items() if name != "fp8" for req in reqs)


# ---------------------------------------------------------------- refused before any work


def test_a_run_without_torchao_or_cuda_is_refused_before_any_work_saying_how(tmp_path, no_torchao, capsys):
    from blunb.train import main, train

    cfg = apply_overrides(preset("tiny"), ["model.fp8=tensorwise", "device=cpu"])
    with pytest.raises(ConfigError) as err:
        train(cfg, tmp_path / "run")
    message = str(err.value)
    assert message.startswith("model.fp8=tensorwise cannot run here: torchao is not importable")
    assert "pip install 'blunb[fp8]'" in message and "pip install --no-index --no-deps --target DIR" in message
    assert "need a CUDA GPU of compute capability >= 8.9 (Ada, Hopper or newer); this run's device is cpu" in message
    assert not (tmp_path / "run").exists()
    with pytest.raises(SystemExit) as exit_:   # the CLI: one line, status 2
        main(["--preset", "tiny", "--set", "model.fp8=rowwise", "--set", "device=cpu", "--run-dir",
              str(tmp_path / "cli")])
    assert exit_.value.code == 2
    assert capsys.readouterr().err.startswith("error: model.fp8=rowwise cannot run here: torchao is not importable")
    assert not (tmp_path / "cli").exists()
    with pytest.raises(SystemExit) as exit_:   # --nproc: refused here, before torchrun would start the ranks
        main(["--preset", "tiny", "--nproc", "2", "--set", "model.fp8=rowwise", "--set", "device=cpu"])
    assert exit_.value.code == 2 and "error: model.fp8=rowwise cannot run here" in capsys.readouterr().err


@pytest.mark.parametrize("capability, refused", [((8, 0), True), ((8, 6), True), ((8, 9), False), ((9, 0), False)])
def test_a_gpu_without_float8_tensor_cores_is_refused_naming_it(monkeypatch, capability, refused):
    monkeypatch.setattr(fp8, "_float8", lambda: None)   # torchao "importable": only the device is in question
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA Test GPU")
    found = fp8.problems(torch.device("cuda", 0))
    expected = [f"float8 GEMMs need compute capability >= 8.9; NVIDIA Test GPU has {capability[0]}.{capability[1]}"]
    assert found == (expected if refused else [])


def test_check_names_every_problem_at_once(no_torchao):
    with pytest.raises(ConfigError, match="torchao is not importable .*; float8 GEMMs need a CUDA GPU"):
        fp8.check("rowwise", torch.device("cpu"))
    assert fp8.torchao_version() is None


def test_a_model_built_with_fp8_outside_the_trainer_says_how_to_get_torchao(no_torchao):
    from blunb.model import BLU

    with pytest.raises(ImportError, match=r"torchao is not importable .*install it: pip install 'blunb\[fp8\]'"):
        BLU(apply_overrides(preset("tiny"), ["model.fp8=rowwise"]).model)


# ---------------------------------------------------------------- with torchao importable


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_the_conversion_swaps_exactly_the_body_linears(tied):
    pytest.importorskip("torchao.float8")
    from torchao.float8.float8_linear import Float8Linear

    from blunb.model import BLU, Linear

    overrides = [f"weight_tying={str(tied).lower()}"]
    plain = BLU(apply_overrides(preset("tiny"), overrides).model, seed=3)
    model = BLU(apply_overrides(preset("tiny"), [*overrides, "model.fp8=tensorwise"]).model, seed=3)
    body = {f"blocks.{i}.{p}" for i in range(len(model.blocks)) for p in fp8.BODY_LINEARS}
    assert {n for n, m in model.named_modules() if isinstance(m, Float8Linear)} == body == set(model.fp8_linears)
    assert {n for n, m in model.named_modules() if type(m) is Linear} == ({"lm_head"} if not tied else set())
    assert type(model.wte) is nn.Embedding and (model.lm_head is None) == tied
    # the same parameters: names, dtypes, values (the swap keeps each weight Parameter, after the init)
    mine, theirs = dict(model.named_parameters()), dict(plain.named_parameters())
    assert list(mine) == list(theirs)
    assert all(mine[n].dtype == theirs[n].dtype and torch.equal(mine[n], theirs[n]) for n in mine)
    assert list(model.state_dict()) == list(plain.state_dict())   # checkpoints read either way
    facts = fp8.describe(model, "tensorwise")
    assert facts["linears"] == 6 * len(model.blocks) and facts["torchao"] == fp8.torchao_version()
    assert facts["casts"] == {"input": "e4m3fn tensorwise", "weight": "e4m3fn tensorwise",
                              "grad_output": "e5m2 tensorwise"}
    assert facts["not_converted"][1] == ("the tied lm_head (a cast of the embedding)" if tied else "lm_head")
    layout = model.precision_layout()
    assert layout["body_gemms"] == f"fp8 tensorwise (torchao {fp8.torchao_version()}; weights fp32)"
    assert plain.precision_layout()["body_gemms"] == "fp32" and plain.fp8_linears == []


def test_a_model_whose_body_moved_is_not_silently_half_converted():
    pytest.importorskip("torchao.float8")
    from blunb.model import BLU

    model = BLU(preset("tiny").model, seed=0)
    model.blocks[1].ffn.down = nn.Identity()   # one Linear gone: 23 of 24
    with pytest.raises(RuntimeError, match="converted 23 Linears, expected 24"):
        fp8.convert_body(model, "rowwise")


@pytest.mark.parametrize("recipe", FP8_RECIPES)
def test_the_plain_baseline_converts_the_same_linears_with_the_same_config(recipe):
    """bench/speed.py's plain_compile-fp8 rows: torchao's conversion as a user would write it, lm_head kept."""
    pytest.importorskip("torchao.float8")
    from torchao.float8.float8_linear import Float8Linear

    from bench.plain_llama import PlainLlama, convert_to_fp8

    cfg = apply_overrides(preset("tiny"), ["weight_tying=false"]).model
    plain = PlainLlama(cfg, "cpu")
    assert convert_to_fp8(plain, recipe) == len(fp8.BODY_LINEARS) * cfg.n_layers
    converted = {n: m for n, m in plain.named_modules() if isinstance(m, Float8Linear)}
    assert len(converted) == len(fp8.BODY_LINEARS) * cfg.n_layers and "lm_head" not in converted
    assert type(plain.lm_head) is nn.Linear
    assert all(m.config == fp8.float8_config(recipe) for m in converted.values())


def float8_rel_error_bound(a_dtype: torch.dtype, b_dtype: torch.dtype) -> float:
    """The normwise relative error of a GEMM whose two operands are each rounded to a float8 dtype, from the
    rounding alone: rounding to nearest with m mantissa bits errs by at most u = 2^-(m+1) of a value (e4m3: 2^-4,
    e5m2: 2^-3), uniformly within that at worst, so with rms u/sqrt(3); a product carries both operands' errors,
    and over K products of random sign the errors add in quadrature as the products do:
    ||err|| / ||out|| = sqrt(u_a^2 + u_b^2) / sqrt(3). Times 1.25 for the accumulation (the output GEMM's fast
    accumulation on Hopper) and the output's bf16 rounding (2^-9)."""
    u = [torch.finfo(d).eps / 2 for d in (a_dtype, b_dtype)]
    return 1.25 * math.sqrt((u[0] ** 2 + u[1] ** 2) / 3)


# A float8 GEMM errs at least this much on random data (measured ~0.037 with two e4m3 operands: the rounding
# averages ~0.7 of its worst case): far above a bf16 GEMM's ~2^-9, so a Linear that silently stayed bf16 fails.
FLOAT8_MIN_REL_ERROR = 2 ** -6


def linear_errors(recipe: str, device: str, M: int, K: int, N: int) -> dict[str, tuple[float, float]]:
    """(relative error, bound) of a converted bf16 Linear's output, input gradient and weight gradient against
    the exact (fp64) GEMMs of the same bf16 values."""
    from blunb.model import Linear

    gen = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(M, K, device=device, generator=gen).bfloat16()
    w = (0.02 * torch.randn(N, K, device=device, generator=gen)).bfloat16()
    g = torch.randn(M, N, device=device, generator=gen).bfloat16()
    holder = nn.ModuleDict({"lin": Linear(K, N, dtype=torch.bfloat16).to(device)})
    with torch.no_grad():
        holder["lin"].weight.copy_(w)
    config = fp8.float8_config(recipe)
    fp8._float8().convert_to_float8_training(holder, config=config)
    xg = x.clone().requires_grad_()
    out = holder["lin"](xg)
    out.backward(g)
    xf, wf, gf = x.double(), w.double(), g.double()   # exact products, no TF32 (the trainer turns it on)
    pairs = {"output": (out, xf @ wf.T, config.cast_config_input, config.cast_config_weight),
             "grad_input": (xg.grad, gf @ wf, config.cast_config_grad_output, config.cast_config_weight),
             "grad_weight": (holder["lin"].weight.grad, gf.T @ xf, config.cast_config_grad_output,
                             config.cast_config_input)}
    return {k: (((got.double() - ref).norm() / ref.norm()).item(), float8_rel_error_bound(a.target_dtype,
                                                                                          b.target_dtype))
            for k, (got, ref, a, b) in pairs.items()}


@pytest.mark.parametrize("recipe", FP8_RECIPES)
def test_a_converted_linear_rounds_as_float8_does_on_the_cpu(recipe):
    """torch's CPU float8 GEMM (torch._scaled_mm has a CPU kernel) at a small shape; the GPU test runs 1b's."""
    pytest.importorskip("torchao.float8")
    for what, (error, bound) in linear_errors(recipe, "cpu", 512, 256, 384).items():
        assert FLOAT8_MIN_REL_ERROR < error < bound, (what, error, bound)


def test_float8_bounds_follow_the_mantissa_bits():
    e4, e5 = torch.float8_e4m3fn, torch.float8_e5m2
    assert float8_rel_error_bound(e4, e4) == pytest.approx(1.25 * math.sqrt(2 * 2 ** -8 / 3))   # 0.064
    assert float8_rel_error_bound(e5, e4) == pytest.approx(1.25 * math.sqrt((2 ** -6 + 2 ** -8) / 3))   # 0.101
    assert FLOAT8_MIN_REL_ERROR > 4 * 2 ** -9

