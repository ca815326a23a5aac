"""Model and training configuration: dataclasses, named presets, `key=value` overrides.

Configs are plain Python. `preset(name)` returns a fresh TrainConfig (whose `.model`
is the ModelConfig); `apply_overrides` takes the CLI's `--set key=value` pairs, where a
key names a TrainConfig field or, with a `model.` prefix or unambiguously, a ModelConfig
field. `validate` raises ConfigError, naming the offending setting, before any work.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
from dataclasses import dataclass, field, fields


class ConfigError(ValueError):
    """A setting that cannot work, reported before any training starts."""


def _check_finite(obj, prefix: str = "") -> None:
    # Every float field, generically: NaN slips through every `<=` check below (max_lr=nan
    # passed validation and died at step 1), so reject non-finite values up front.
    for f in fields(obj):
        value = getattr(obj, f.name)
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"{prefix}{f.name} must be a finite number, got {value}")


def _parse_faults(name: str, spec: str) -> set[tuple[int, int]]:
    """'STEP:RANK[,STEP:RANK...]' -> {(step, rank)}; '' -> empty."""
    out: set[tuple[int, int]] = set()
    if not spec.strip():
        return out
    for item in spec.split(","):
        step_txt, _, rank_txt = item.strip().partition(":")
        try:
            step, rank = int(step_txt), int(rank_txt)
        except ValueError:
            raise ConfigError(f"{name} must be STEP:RANK[,STEP:RANK...] with integer STEP and RANK, "
                              f"got {item.strip()!r} in {spec!r}") from None
        if step < 0 or rank < 0:
            raise ConfigError(f"{name}: STEP and RANK must be >= 0, got {item.strip()!r}")
        out.add((step, rank))
    return out


def _check_lr_pair(hi_name: str, hi: float, lo_name: str, lo: float) -> None:
    if lo < 0 or hi <= 0 or lo > hi:
        raise ConfigError(f"need 0 <= {lo_name} <= {hi_name} and {hi_name} > 0, got {lo_name}={lo}, {hi_name}={hi}")


# The per-stage precision flags (ModelConfig fields) that the `all_bf16` override sets together.
BF16_STAGES = ("bf16_resid", "bf16_logits", "bf16_embed")
ALL_BF16 = "all_bf16"
# model.fp8: the scaling recipes of torchao's float8 training that the body's Linears can run (blunb/fp8.py), and
# the multiple its GEMMs (torch._scaled_mm) need of both sides of every weight and of the tokens a weight
# gradient sums over.
FP8_RECIPES = ("tensorwise", "rowwise")
FP8_ALIGN = 16

# The train data orders (blunb.data.build_train_loader): "windows" a seeded permutation of the
# split's T-token windows, fresh each epoch; "shards" the legacy one (the shard files permuted,
# then read strided), which only reproduces runs made before data_order existed.
DATA_ORDERS = ("windows", "shards")
# The fields seed stands in for when they are None.
OPTIONAL_SEEDS = ("data_seed", "init_seed")
# What a config.json without a field was run with, where that is not today's default or may stop being it: such
# a run must not pass for one of today's (TrainConfig.from_dict, the study cache). "model" holds ModelConfig's.
# muon_ns_schedule, muon_ns_precondition: every run before the field ran the fixed coefficients from a Frobenius-
# normalized start, whatever the default becomes.
PREDATED = {"data_order": "shards", "compile": False, "muon_ns_schedule": "fixed", "muon_ns_precondition": "none",
            "cuda_graph": False, "model": {"chunked_ce": False}}


def _merged(under: dict, over: dict) -> dict:
    return {**under, **over, "model": {**under.get("model", {}), **over.get("model", {})}}


def _with_predated(d: dict) -> dict:
    """A config.json's dict with the PREDATED fields it lacks filled in (what such a run ran with)."""
    return _merged(PREDATED, d)


def predated_defaults() -> dict:
    """What a config.json that lacks a field ran with: today's defaults, with PREDATED's values over them."""
    return _merged(json.loads(TrainConfig().to_json()), PREDATED)
# Settings whose default, "auto", the device decides (TrainConfig.resolve_auto): on CUDA both are on, the
# fastest setting measured on the H200 (compile with the chunked loss: 1.026x plain torch.compile's tok/s at
# 124m, 1.031x at 1b, results/bench/); on the CPU both are off (the eager path: compiling is not timed there).
AUTO_SWITCHES = ("compile", "model.chunked_ce")
# Settings that take true, false or auto where more than the device decides auto: cuda_graph (blunb.cuda_graph.decide,
# which also reads the world size and the other settings).
AUTO_VALUED = (*AUTO_SWITCHES, "cuda_graph")


def auto_switch(value, device_type: str) -> bool:
    """A compile / model.chunked_ce value, "auto" decided for `device_type` ("cuda" | "cpu")."""
    return device_type == "cuda" if value == "auto" else bool(value)


def _check_switch(name: str, value) -> None:
    if not isinstance(value, bool) and value != "auto":
        raise ConfigError(f"{name} must be true, false or auto, got {value!r}")


@dataclass
class ModelConfig:
    d_model: int = 3072
    n_layers: int = 36
    q_heads: int = 24
    kv_heads: int = 8
    head_dim: int = 128
    ffn_hidden: int = 8192
    context_length: int = 4096
    rope_theta: float = 500000.0
    vocab_size: int = 50304
    weight_tying: bool = False
    rms_eps: float = 1e-5
    qk_eps: float = 1e-6
    rope_interleaved: bool = False  # False: NeoX half-split; True: GPT-J pairs
    # Each flag moves exactly one stage from fp32 to bf16 (the seed's bisectable layout). The
    # override `all_bf16=true` (the seed's BLU_ALL_BF16) sets all three; see apply_overrides.
    bf16_resid: bool = False   # residual stream + block RMSNorm scales
    bf16_logits: bool = False  # logits (the loss itself is always fp32 here)
    bf16_embed: bool = False   # token embedding (and the tied lm_head)
    # Linear weights: "auto" = bf16 on CUDA, fp32 on CPU; or "bf16" / "fp32".
    linear_dtype: str = "auto"
    # The body's Linears (attention wq/wk/wv/wo, MLP gate_up/down) as torchao float8 training Linears, "off" or a
    # scaling recipe (FP8_RECIPES): each GEMM casts its operands to float8 with dynamic scales, the weights stay in
    # linear_dtype; lm_head and the embedding are never converted. Needs torchao and CUDA >= 8.9 (blunb/fp8.py).
    fp8: str = "off"
    # lm_head + loss in token chunks (kernels/linear_cross_entropy.py): the [B*T, V] logits and their
    # gradient are never materialized, and forward(idx, targets) returns (None, loss). Same math and
    # dtypes as the plain path; forward(idx) without targets still returns the logits. "auto": on CUDA.
    chunked_ce: bool | str = "auto"

    def validate(self) -> None:
        _check_finite(self, "model.")
        for name in ("d_model", "n_layers", "q_heads", "kv_heads", "head_dim", "ffn_hidden",
                     "context_length", "vocab_size"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"model.{name} must be positive, got {getattr(self, name)}")
        if self.q_heads % self.kv_heads:
            raise ConfigError(f"model.q_heads ({self.q_heads}) must be divisible by "
                              f"model.kv_heads ({self.kv_heads}) for grouped-query attention")
        if self.head_dim % 2:
            raise ConfigError(f"model.head_dim must be even for RoPE, got {self.head_dim}")
        if self.linear_dtype not in ("auto", "bf16", "fp32"):
            raise ConfigError(f"model.linear_dtype must be auto, bf16 or fp32, got {self.linear_dtype!r}")
        if self.rms_eps <= 0 or self.qk_eps <= 0 or self.rope_theta <= 0:
            raise ConfigError("model.rms_eps, model.qk_eps and model.rope_theta must be positive")
        _check_switch("model.chunked_ce", self.chunked_ce)
        self._check_fp8()

    def _check_fp8(self) -> None:
        if self.fp8 not in ("off", *FP8_RECIPES):
            raise ConfigError(f"model.fp8 must be off or one of {FP8_RECIPES}, got {self.fp8!r}")
        if self.fp8 == "off":
            return
        dims = {"d_model": self.d_model, "q_heads*head_dim": self.q_heads * self.head_dim,
                "kv_heads*head_dim": self.kv_heads * self.head_dim, "ffn_hidden": self.ffn_hidden}
        bad = [f"{name} = {value}" for name, value in dims.items() if value % FP8_ALIGN]
        if bad:
            raise ConfigError(f"model.fp8={self.fp8}: float8 GEMMs need every dimension of the body's Linears "
                              f"divisible by {FP8_ALIGN}, got {', '.join(bad)}")

    def num_params(self) -> int:
        """Exact parameter count of BLU(self) (tests hold the model to it)."""
        d, hd, F = self.d_model, self.head_dim, self.ffn_hidden
        attn = d * (self.q_heads * hd) + 2 * d * (self.kv_heads * hd) + (self.q_heads * hd) * d + 2 * hd
        ffn = d * 2 * F + F * d
        block = attn + ffn + 2 * d  # + the two RMSNorm scales
        embed = self.vocab_size * d
        head = 0 if self.weight_tying else self.vocab_size * d
        return embed + self.n_layers * block + d + head


@dataclass
class TrainConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    preset: str = "custom"
    B: int = 2                      # micro-batch per rank
    T: int = 4096                   # sequence length
    global_batch: int = 2097152     # tokens per optimizer step, all ranks
    grad_clip: float = 1.0
    weight_decay: float = 0.1
    max_lr: float = 6e-4
    min_lr: float = 6e-5
    warmup_steps: int = 200
    stable_steps: int = 1400
    max_steps: int = 2000
    # "adamw" (ZeRO-1) | "muon" (ZeRO-1 Muon + AdamW) | "ddp_adamw" (torch) | "adamw_bf16_nomaster"
    # (torch AdamW on bf16 parameters without fp32 masters: the precision study's counter-example only)
    optimizer: str = "adamw"
    muon_lr: float = 8e-4
    muon_min_lr: float = 8e-5
    muon_momentum: float = 0.95
    muon_weight_decay: float = 0.1
    muon_ns_steps: int = 5
    # Newton-Schulz coefficients per iteration (blunb.optim.newton_schulz.NS_SCHEDULES): "fixed" (torch.optim.Muon's
    # one quintic at every step) or "polar_express" (Amsel et al. 2025: each step's own minimax quintic, bf16 safety
    # factor; past its 8 published steps the last one repeats, the paper's rule). muon_ns_steps counts either.
    muon_ns_schedule: str = "fixed"
    # The first iteration's start (newton_schulz.PRECONDITIONS): "none" (X / ||X||_F, torch.optim.Muon's) or "aol"
    # (then each row scaled by AOL's 1 / sqrt(sum_j |(X X^T)_ij|), Turbo-Muon's start: the small singular values start
    # higher, about one fixed-quintic iteration's worth, at no extra GEMM). The schedule's coefficients stay.
    muon_ns_precondition: str = "none"
    muon_adjust_lr: str = "match_rms_adamw"  # or "original"
    # ZeRO-1 switches (the seed's A/B flags)
    collective: str = "rs_ag"       # AdamW groups: "rs_ag" | "reduce_bcast"
    muon_collective: str = "rs_ag"  # the Muon group, on its own (the seed: AdamW reduce_bcast, Muon rs_ag)
    muon_buckets: int = 6           # Muon rs_ag: buckets per dtype (each one reduce-scatter + one all-gather)
    reduce_dtype: str = "param"     # "param" | "fp32" | "bf16"
    overlap_backward: bool = False  # reduce gradient buckets from autograd hooks during backward
    overlap_refresh: bool = False   # publish updated params in stages, installed by forward pre-hooks
    bucket_mb: float = 50.0
    global_clip: bool = False       # one clip coefficient across groups (two-phase)
    global_clip_strict: bool = False  # derive it from the full norm, not the covered part
    diag: bool = False              # check replicas are bit-identical at every validation
    max_consecutive_skips: int = 20  # stop the run after this many skipped (non-finite) steps in a row
    diverged_skip_frac: float = 0.5  # a run that skipped more than this fraction of its steps ends "diverged"
    # "step": a non-finite gradient norm in any group skips the whole step on every rank;
    # "group": the reference trainer's per-group skip (the other groups still step).
    nan_policy: str = "step"
    fault_nan_grad: str = ""        # testing aid: "STEP:RANK[,...]" poisons that rank's gradient on that step
    fault_stall: str = ""           # testing aid: "STEP:RANK[,...]" SIGSTOPs that rank at the start of that step
    collective_timeout_s: float = 600.0  # every collective's timeout (torch's default is 30 minutes)
    # Validation set size in tokens, split across ranks (so val_loss means the same at every world
    # size): the reference trainer's 20 batches x B2 x T4096 x 8 ranks. 0: val_loss_steps * B * T.
    val_tokens: int = 1310720
    val_freq: int = 250
    val_loss_steps: int = 20
    seed: int = 1337                # both of the next two unless they are given
    data_seed: int | None = None    # the train data order (None: seed); a study holds it to vary init only
    init_seed: int | None = None    # the model's init and torch's / numpy's global RNGs (None: seed)
    data_order: str = "windows"     # DATA_ORDERS; "shards" reproduces the runs made before this field
    data: str = "default"           # "default" (embedded corpus) or a folder of .bin shards
    device: str = "auto"            # "auto" | "cpu" | "cuda"
    kernels: str = "auto"           # "auto" | "torch" | "triton" | per op, e.g. "swiglu=torch,qk_norm_rope=torch"
    compile: bool | str = "auto"    # torch.compile the model's forward + backward (optimizers stay eager); auto: CUDA
    # Bit-reproducible GPU runs: torch's deterministic algorithms (an op without one fails naming itself),
    # CUBLAS_WORKSPACE_CONFIG, cuDNN deterministic, fixed Triton kernel configs and no timed backend choice
    # (blunb.train applies and records the knobs; docs/architecture.md). Costs some speed.
    deterministic: bool = False
    # The steady-state training step (every micro-batch's forward + backward, the clip, the optimizer update) captured
    # once as a CUDA graph and replayed (blunb/cuda_graph.py): true | false | auto (on where it is supported: CUDA,
    # world size 1, the ZeRO AdamW or Muon set; the start lines say what was picked and why). Default false: the
    # gain bench/speed.py measured is 0.4-3.3% (124m / 1b / seed-4b, one H200 call each), and a failed capture still
    # stops the run; auto is the intended default once it falls back to eager (results/bench/README.md).
    cuda_graph: bool | str = False
    mfu_warmup: int = 5             # steps excluded from steady-state MFU
    ckpt_freq: int = 0              # checkpoint every this many steps (0: never, so throughput A/Bs stay clean)
    ckpt_keep: int = 2              # the newest this many valid checkpoints are kept
    # torch.profiler over this many steps before the last (rank 0; fewer when a validation falls among
    # them: the profile holds training steps only): profile.csv (GPU time per step by category) and
    # profile_kernels.csv in the run folder. Profiled steps run slower: leave them out of throughput figures.
    profile_steps: int = 0

    def grad_accum_steps(self, world_size: int) -> int:
        return self.global_batch // (self.B * self.T * world_size)

    def validate(self, world_size: int = 1) -> None:
        self.model.validate()
        _check_finite(self)
        for name in ("B", "T", "global_batch", "max_steps", "val_freq", "val_loss_steps"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)}")
        if self.T > self.model.context_length:
            raise ConfigError(f"T ({self.T}) exceeds model.context_length ({self.model.context_length})")
        per_step = self.B * self.T * world_size
        if self.global_batch % per_step:
            raise ConfigError(f"global_batch ({self.global_batch}) must be divisible by "
                              f"B*T*world_size = {self.B}*{self.T}*{world_size} = {per_step}")
        if self.model.fp8 != "off" and (self.B * self.T) % FP8_ALIGN:
            raise ConfigError(f"model.fp8={self.model.fp8}: the weight gradient's float8 GEMM multiplies over a "
                              f"micro-batch's B*T tokens, which must be divisible by {FP8_ALIGN}, got "
                              f"B*T = {self.B}*{self.T} = {self.B * self.T}")
        if self.warmup_steps < 0 or self.stable_steps < 0:
            raise ConfigError("warmup_steps and stable_steps must be >= 0")
        if self.warmup_steps + self.stable_steps >= self.max_steps:
            raise ConfigError(f"WSD schedule has no decay tail: warmup_steps ({self.warmup_steps}) + "
                              f"stable_steps ({self.stable_steps}) must be < max_steps ({self.max_steps})")
        # Imported here, not at the top: `import blunb.config` stays torch-free (runs, study, launch read configs).
        from blunb.optim.build import OPTIMIZERS
        from blunb.optim.layout import COLLECTIVES, REDUCE_DTYPES
        from blunb.optim.muon import ADJUST_LR
        from blunb.optim.newton_schulz import NS_SCHEDULES, PRECONDITIONS

        choices = {"optimizer": tuple(OPTIMIZERS), "collective": COLLECTIVES,
                   "muon_collective": COLLECTIVES, "reduce_dtype": tuple(REDUCE_DTYPES), "muon_adjust_lr": ADJUST_LR,
                   "muon_ns_schedule": tuple(NS_SCHEDULES), "muon_ns_precondition": PRECONDITIONS,
                   "nan_policy": ("step", "group")}
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise ConfigError(f"{name} must be one of {allowed}, got {getattr(self, name)!r}")
        if self.bucket_mb <= 0:
            raise ConfigError(f"bucket_mb must be positive, got {self.bucket_mb}")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ConfigError(f"device must be auto, cpu or cuda, got {self.device!r}")
        from blunb.kernels import parse_backends

        try:
            parse_backends(self.kernels)
        except ValueError as err:
            raise ConfigError(str(err)) from None
        _check_switch("compile", self.compile)
        _check_switch("cuda_graph", self.cuda_graph)
        if self.cuda_graph is True:
            from blunb.cuda_graph import check

            check(self, None if self.device == "auto" else self.device, world_size)
        if not isinstance(self.deterministic, bool):
            raise ConfigError(f"deterministic must be true or false, got {self.deterministic!r}")
        _check_lr_pair("max_lr", self.max_lr, "min_lr", self.min_lr)
        _check_lr_pair("muon_lr", self.muon_lr, "muon_min_lr", self.muon_min_lr)
        for name in ("weight_decay", "muon_weight_decay", "grad_clip"):  # grad_clip 0 = off
            if getattr(self, name) < 0:
                raise ConfigError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.collective_timeout_s <= 0:
            raise ConfigError(f"collective_timeout_s must be positive, got {self.collective_timeout_s}")
        if not 0 <= self.diverged_skip_frac <= 1:
            raise ConfigError(f"diverged_skip_frac must be in [0, 1] (the fraction of skipped steps above which a "
                              f"run ends diverged), got {self.diverged_skip_frac}")
        if self.val_tokens < 0:
            raise ConfigError(f"val_tokens must be >= 0 (0 = val_loss_steps * B * T), got {self.val_tokens}")
        for name in ("fault_nan_grad", "fault_stall"):
            for step, rank in _parse_faults(name, getattr(self, name)):
                if rank >= world_size:
                    raise ConfigError(f"{name}: rank {rank} (step {step}) does not exist at world_size {world_size}")
        if not 0 <= self.profile_steps < self.max_steps - 1:
            raise ConfigError(f"profile_steps must be >= 0 and < max_steps - 1 ({self.max_steps - 1}: the steps "
                              f"before the last), got {self.profile_steps}")
        if self.ckpt_freq < 0 or self.ckpt_keep < 1:
            raise ConfigError(f"ckpt_freq must be >= 0 (0 = off) and ckpt_keep >= 1, got {self.ckpt_freq} and "
                              f"{self.ckpt_keep}")
        for name in ("seed", *OPTIONAL_SEEDS):
            value = getattr(self, name)
            if value is None and name in OPTIONAL_SEEDS:
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ConfigError(f"{name} must be an integer >= 0" + (" or None (= seed)" if name != "seed" else "")
                                  + f", got {value!r}")
        if self.data_order not in DATA_ORDERS:
            raise ConfigError(f"data_order must be one of {DATA_ORDERS}, got {self.data_order!r}")
        if self.muon_buckets < 1:
            raise ConfigError(f"muon_buckets must be >= 1, got {self.muon_buckets}")
        if self.muon_ns_steps < 1:
            raise ConfigError(f"muon_ns_steps must be >= 1 (Newton-Schulz iterations), got {self.muon_ns_steps}")
        spec = OPTIMIZERS[self.optimizer]
        if not spec.zero_switches:
            # e.g. torch AdamW never reads them: an A/B run with one set would silently measure nothing.
            defaults = {f.name: f.default for f in fields(TrainConfig)}
            ignored = [f"{k}={getattr(self, k)!r}" for k in _ZERO_ONLY if getattr(self, k) != defaults[k]]
            if ignored:
                raise ConfigError(f"optimizer={self.optimizer} would ignore these ZeRO-1 switches: "
                                  f"{', '.join(ignored)}; reset them or use optimizer=adamw")
        problem = spec.check(self) if spec.check is not None else None
        if problem:
            raise ConfigError(f"optimizer={self.optimizer}: {problem}")

    def fault_nan_grad_at(self) -> set[tuple[int, int]]:
        """The (step, rank) pairs whose gradient fault_nan_grad poisons."""
        return _parse_faults("fault_nan_grad", self.fault_nan_grad)

    def fault_stall_at(self) -> set[tuple[int, int]]:
        """The (step, rank) pairs that fault_stall SIGSTOPs."""
        return _parse_faults("fault_stall", self.fault_stall)

    def resolved_data_seed(self) -> int:
        """The seed of the train data order: data_seed, or seed when it is None."""
        return self.seed if self.data_seed is None else self.data_seed

    def resolve_auto(self, device_type: str) -> dict[str, bool]:
        """Decide, in place, each AUTO_SWITCHES setting left at "auto" for `device_type`, so config.json
        records what ran; returns those it decided, by name."""
        decided = {}
        for name in AUTO_SWITCHES:
            owner, attr = (self.model, name[len("model."):]) if name.startswith("model.") else (self, name)
            if getattr(owner, attr) == "auto":
                decided[name] = auto_switch("auto", device_type)
                setattr(owner, attr, decided[name])
        return decided

    def resolved_init_seed(self) -> int:
        """The seed of the model's init: init_seed, or seed when it is None."""
        return self.seed if self.init_seed is None else self.init_seed

    def resolved_val_tokens(self) -> int:
        """Validation tokens over all ranks, a whole number of sequences (>= 1). The default does not
        depend on world size, so val_loss measures the same tokens at every W."""
        n = self.val_tokens or self.val_loss_steps * self.B * self.T
        return max(self.T, n // self.T * self.T)

    def rescale_schedule(self, max_steps: int) -> None:
        """The seed's BLU_MAX_STEPS: warmup N/10, stable N/2, cosine decay over the rest."""
        if max_steps < 3:
            raise ConfigError(f"--max-steps must be >= 3 to leave a decay tail, got {max_steps}")
        self.max_steps = max_steps
        self.warmup_steps = max(1, max_steps // 10)
        self.stable_steps = max_steps // 2
        self.val_freq = min(self.val_freq, max_steps)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "TrainConfig":
        d = _with_predated(d)
        model = ModelConfig(**d.pop("model"))
        return cls(model=model, **d)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)


# TrainConfig switches only the ZeRO-1 optimizers read (the others reject them: OptimizerSpec.zero_switches).
_ZERO_ONLY = ("collective", "muon_collective", "muon_buckets", "reduce_dtype", "overlap_backward", "overlap_refresh",
              "bucket_mb", "global_clip", "global_clip_strict")


def _tiny() -> TrainConfig:
    # Trains on a laptop CPU in seconds; vocab 320 covers the 257-symbol byte tokenizer.
    model = ModelConfig(d_model=128, n_layers=4, q_heads=4, kv_heads=2, head_dim=32, ffn_hidden=352,
                        context_length=128, vocab_size=320, weight_tying=True)
    return TrainConfig(model=model, preset="tiny", B=8, T=128, global_batch=4096, max_lr=3e-3,
                       min_lr=3e-4, muon_lr=3e-3, muon_min_lr=3e-4, warmup_steps=10,
                       stable_steps=50, max_steps=100, val_freq=20, val_loss_steps=4, val_tokens=8192)


def _gpt2_small() -> TrainConfig:
    model = ModelConfig(d_model=768, n_layers=12, q_heads=12, kv_heads=4, head_dim=64, ffn_hidden=2048,
                        context_length=1024, vocab_size=50304, weight_tying=True)
    return TrainConfig(model=model, preset="124m", B=16, T=1024, global_batch=524288, val_tokens=327680,
                       warmup_steps=200, stable_steps=1400, max_steps=2000)


def _one_b() -> TrainConfig:
    model = ModelConfig(d_model=2048, n_layers=16, q_heads=16, kv_heads=8, head_dim=128, ffn_hidden=5632,
                        context_length=2048, vocab_size=50304, weight_tying=False)
    return TrainConfig(model=model, preset="1b", B=8, T=2048, global_batch=524288, val_tokens=327680,
                       warmup_steps=200, stable_steps=1400, max_steps=2000)


def _seed_4b() -> TrainConfig:
    # The C++ seed's production run, field for field.
    return TrainConfig(model=ModelConfig(), preset="seed-4b")


PRESETS = {"tiny": _tiny, "124m": _gpt2_small, "1b": _one_b, "seed-4b": _seed_4b}


def preset(name: str) -> TrainConfig:
    if name not in PRESETS:
        raise ConfigError(f"unknown preset {name!r}; known presets: {', '.join(PRESETS)}")
    return PRESETS[name]()


def _parse_value(raw: str, current):
    if isinstance(current, bool):
        if raw.lower() in ("1", "true", "yes", "on"):
            return True
        if raw.lower() in ("0", "false", "no", "off"):
            return False
        raise ConfigError(f"expected a boolean, got {raw!r}")
    if isinstance(current, int):
        try:
            return int(float(raw)) if float(raw).is_integer() else int(raw)
        except ValueError:
            raise ConfigError(f"expected an integer, got {raw!r}") from None
    if isinstance(current, float):
        try:
            return float(raw)
        except ValueError:
            raise ConfigError(f"expected a number, got {raw!r}") from None
    return raw


def settings_help(cfg: TrainConfig) -> str:
    """Every `--set` key with its value in `cfg`, one per line (what `--help-settings` prints)."""
    lines = [f"{f.name} = {getattr(cfg, f.name)!r}" for f in fields(TrainConfig) if f.name != "model"]
    lines += [f"model.{f.name} = {getattr(cfg.model, f.name)!r}" for f in fields(ModelConfig)]
    lines.append(f"{ALL_BF16} = (sets {', '.join(BF16_STAGES)})")
    return "\n".join(lines)


def _suggest(key: str, known: set[str]) -> str:
    """ "; did you mean ...?" with the nearest known keys (a full listing of ~80 keys helps nobody)."""
    close = difflib.get_close_matches(key.removeprefix("model."), sorted(known), n=3, cutoff=0.6)
    if not close:
        return " (`blunb-train --help-settings` lists every setting)"
    return f"; did you mean {' or '.join(close)}?"


def apply_overrides(cfg: TrainConfig, overrides: list[str]) -> TrainConfig:
    """Apply `key=value` strings in order; unknown keys are an error naming the key.

    `all_bf16=BOOL` (or `model.all_bf16`, the seed's BLU_ALL_BF16) sets the three BF16_STAGES
    flags at once; a per-stage override after it wins (`all_bf16=true bf16_embed=false`: residual
    and logits only), as the seed's per-stage knobs do. The flags themselves are what config.json
    records.
    """
    train_keys = {f.name for f in fields(TrainConfig)} - {"model"}
    model_keys = {f.name for f in fields(ModelConfig)}
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} is not of the form key=value")
        key, raw = (s.strip() for s in item.split("=", 1))
        if key in (ALL_BF16, f"model.{ALL_BF16}"):
            try:
                on = _parse_value(raw, False)
            except ConfigError as err:
                raise ConfigError(f"override {item!r}: {err}") from None
            for name in BF16_STAGES:
                setattr(cfg.model, name, on)
            continue
        if key.startswith("model."):
            target, name = cfg.model, key[len("model."):]
            if name not in model_keys:
                raise ConfigError(f"unknown model setting {name!r} in override {item!r}"
                                  f"{_suggest(name, model_keys | {ALL_BF16})}")
        elif key in train_keys:
            target, name = cfg, key
        elif key in model_keys:
            target, name = cfg.model, key
        else:
            raise ConfigError(f"unknown setting {key!r} in override {item!r}"
                              f"{_suggest(key, train_keys | model_keys | {ALL_BF16})}")
        try:
            if target is cfg and name in OPTIONAL_SEEDS:  # None by default: the type is not in the value
                value = None if raw.lower() == "none" else _parse_value(raw, 0)
            elif (name if target is cfg else f"model.{name}") in AUTO_VALUED:  # a bool, or "auto"
                if raw.lower() not in ("auto", "1", "true", "yes", "on", "0", "false", "no", "off"):
                    raise ConfigError(f"expected true, false or auto, got {raw!r}")
                value = "auto" if raw.lower() == "auto" else _parse_value(raw, False)
            else:
                value = _parse_value(raw, getattr(target, name))
            setattr(target, name, value)
        except ConfigError as err:
            raise ConfigError(f"override {item!r}: {err}") from None
    return cfg
