"""model.fp8: the transformer body's Linears as torchao float8 training Linears (tensorwise or rowwise scales).

torchao's convert_to_float8_training swaps nn.Linear modules for its Float8Linear, whose GEMMs cast input, weight
and output gradient to float8 with dynamic scales (torch._scaled_mm) while the weight, its gradient and what is
saved for backward keep their own dtype: parameter names, optimizers and checkpoints see the same model. blunb's
Linear is an nn.Linear subclass (its forward differs only for the CPU's bf16 GEMM), so torchao's own swap
applies, narrowed by a module filter to each block's six Linears; lm_head, the tied head (a cast of the
embedding) and the embedding keep their dtype. torchao is an optional extra (`pip install 'blunb[fp8]'`),
imported only when fp8 is on; `check` refuses a run before any work without it, without CUDA or below compute
capability 8.9. The swap comes before torch.compile, under which torchao's casts are meant to run (fused into
their neighbours; eager, each cast is kernels of its own). Details: docs/architecture.md, section
"blunb/fp8.py".
"""

from __future__ import annotations

import re

import torch
import torch.nn as nn

from blunb.config import FP8_RECIPES, ConfigError

# The Linears of a block that fp8 converts, by their names in BLU (blocks.<i>.<path>).
BODY_LINEARS = ("attn.wq", "attn.wk", "attn.wv", "attn.wo", "ffn.gate_up", "ffn.down")
_BODY_FQN = re.compile(r"blocks\.\d+\.(" + "|".join(re.escape(p) for p in BODY_LINEARS) + ")")
# float8 tensor cores: Ada (8.9) and Hopper (9.0) on; torch._scaled_mm refuses anything older.
MIN_CAPABILITY = (8, 9)
TORCHAO = "torchao==0.18.0"   # the version pyproject's fp8 extra pins
INSTALL_HINT = (f"pip install 'blunb[fp8]' ({TORCHAO}); on a machine without a package index, download the wheel "
                f"where there is one (pip download --no-deps {TORCHAO}), carry it over and install it with "
                "pip install --no-index --no-deps --target DIR torchao-*.whl, with DIR on PYTHONPATH")


def _float8():
    """torchao.float8; without torchao an ImportError that says how to install it."""
    try:
        import torchao.float8
    except ImportError as err:
        raise ImportError(f"torchao is not importable ({err}); install it: {INSTALL_HINT}") from err
    return torchao.float8


def torchao_version() -> str | None:
    """The importable torchao's version, or None without one."""
    try:
        import torchao
    except ImportError:
        return None
    return torchao.__version__


def is_body_linear(module: nn.Module, fqn: str) -> bool:
    """Whether fp8 converts this module: an nn.Linear at one of BODY_LINEARS of a block."""
    return isinstance(module, nn.Linear) and _BODY_FQN.fullmatch(fqn) is not None


def problems(device: torch.device) -> list[str]:
    """Every reason model.fp8 (either recipe) cannot run on `device` here (empty when it can)."""
    found = []
    try:
        _float8()
    except ImportError as err:
        found.append(str(err))
    if device.type != "cuda":
        found.append(f"float8 GEMMs need a CUDA GPU of compute capability >= {'.'.join(map(str, MIN_CAPABILITY))} "
                     f"(Ada, Hopper or newer); this run's device is {device.type}")
    elif torch.cuda.get_device_capability(device) < MIN_CAPABILITY:
        cap = ".".join(map(str, torch.cuda.get_device_capability(device)))
        found.append(f"float8 GEMMs need compute capability >= {'.'.join(map(str, MIN_CAPABILITY))}; "
                     f"{torch.cuda.get_device_name(device)} has {cap}")
    return found


def check(recipe: str, device: torch.device) -> None:
    """Refuse (ConfigError, every reason at once) model.fp8=`recipe` where it cannot run; called before any work."""
    found = problems(device)
    if found:
        raise ConfigError(f"model.fp8={recipe} cannot run here: " + "; ".join(found))


def float8_config(recipe: str):
    """torchao's Float8LinearConfig of a recipe: its own "tensorwise" or "rowwise" recipe, unchanged."""
    if recipe not in FP8_RECIPES:
        raise ValueError(f"fp8 recipe must be one of {FP8_RECIPES}, got {recipe!r}")
    return _float8().Float8LinearConfig.from_recipe_name(recipe)


def convert_body(model: nn.Module, recipe: str) -> list[str]:
    """Swap the body's Linears of a BLU `model` for torchao Float8Linears, in place; returns their names.
    Each keeps its weight Parameter (same tensor, name and dtype)."""
    converted: list[str] = []

    def body(module: nn.Module, fqn: str) -> bool:
        if is_body_linear(module, fqn):
            converted.append(fqn)
            return True
        return False

    _float8().convert_to_float8_training(model, module_filter_fn=body, config=float8_config(recipe))
    expected = len(BODY_LINEARS) * len(model.blocks)
    if len(converted) != expected:  # the model's structure moved away from BODY_LINEARS
        raise RuntimeError(f"model.fp8 converted {len(converted)} Linears, expected {expected} "
                           f"({len(BODY_LINEARS)} per block: {', '.join(BODY_LINEARS)})")
    return converted


def _cast(cast_config) -> str:
    return f"{str(cast_config.target_dtype).removeprefix('torch.float8_')} {cast_config.scaling_granularity.value}"


def describe(model: nn.Module, recipe: str) -> dict:
    """env.json's training.fp8: what a converted BLU runs in float8 and what it leaves alone."""
    config = model.get_submodule(model.fp8_linears[0]).config
    return {"recipe": recipe, "torchao": torchao_version(), "linears": len(model.fp8_linears),
            "modules": [f"blocks.*.{p}" for p in BODY_LINEARS],
            "not_converted": ["wte (embedding)", "lm_head" if model.lm_head is not None
                              else "the tied lm_head (a cast of the embedding)"],
            "casts": {"input": _cast(config.cast_config_input), "weight": _cast(config.cast_config_weight),
                      "grad_output": _cast(config.cast_config_grad_output)},
            "scales_rounded_to_power_of_2": config.round_scales_to_power_of_2,
            "fast_accum": {"output": config.gemm_config_output.use_fast_accum,
                           "grad_input": config.gemm_config_grad_input.use_fast_accum,
                           "grad_weight": config.gemm_config_grad_weight.use_fast_accum}}


def start_lines(facts: dict, compiled: bool) -> list[str]:
    """The start-of-run lines of a run with fp8 on, from env.json's training.fp8."""
    casts = ", ".join(f"{k} {v}" for k, v in facts["casts"].items())
    line = (f"fp8: {facts['linears']} body Linears ({', '.join(BODY_LINEARS)} of every block) through torchao "
            f"{facts['torchao']} float8 training, {facts['recipe']}: {casts}"
            + (", scales rounded to powers of 2" if facts["scales_rounded_to_power_of_2"] else "")
            + f"; not converted: {', '.join(facts['not_converted'])}")
    if compiled:
        return [line]
    return [line, "  WARNING: model.fp8 with compile=false: torchao's scaling casts run as kernels of their own, "
                  "unfused, so the step is slower than compiled (and can be slower than bf16)"]
