"""Frozen configuration dataclasses, built once from checkpoint JSON/metadata and CLI flags.

They are hashable so jitted step functions can take them as static arguments.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from dflash_jax.errors import CheckpointError

SUPPORTED_TARGET_ARCHS = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "Qwen3ForCausalLM": "qwen3",
}

# What transformers' config class of each `model_type` assumes for a field config.json leaves out (its class
# defaults and `__post_init__`), for the fields that change the computation. None = derived: num_key_value_heads
# -> num_attention_heads, head_dim -> hidden_size // num_attention_heads.
HF_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {"num_key_value_heads": None, "head_dim": None, "max_position_embeddings": 2048},
    "mistral": {"num_key_value_heads": 8, "head_dim": None, "max_position_embeddings": 131072, "sliding_window": 4096},
    "qwen3": {
        "num_key_value_heads": 32,
        "head_dim": 128,
        "max_position_embeddings": 32768,
        "sliding_window": 4096,
        "max_window_layers": 28,
    },
}
# the config fields each model class of transformers builds bias tensors from (the others ignore them)
HF_BIAS_FIELDS = {"llama": ("attention_bias", "mlp_bias"), "mistral": (), "qwen3": ("attention_bias",)}

# `hidden_act` names of transformers' ACT2FN that the MLP computes (models.layers.ACTIVATIONS maps each to its
# function); the others (`prelu`, `xielu`: activations with weights of their own) are refused.
HF_ACTIVATIONS = (
    "silu",
    "swish",
    "gelu",
    "gelu_python",
    "gelu_new",
    "gelu_pytorch_tanh",
    "gelu_python_tanh",
    "gelu_accurate",
    "gelu_fast",
    "gelu_10",
    "quick_gelu",
    "relu",
    "relu2",
    "relu6",
    "leaky_relu",
    "sigmoid",
    "tanh",
    "linear",
    "mish",
    "hardswish",
    "laplace",
    "sqrtsoftplus",
)

FULL_ATTENTION, SLIDING_ATTENTION = "full_attention", "sliding_attention"


@dataclass(frozen=True)
class RopeScaling:
    """RoPE scaling of HF configs (`rope_parameters` / `rope_scaling`). Supported: `llama3` (Llama 3.1+), `linear`
    and `yarn`; `freq_factors` is llama3-style scaling baked per frequency (GGUF `rope_freqs.weight`)."""

    rope_type: str
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    freq_factors: tuple[float, ...] = ()  # `freq_factors`: per-frequency divisors (GGUF rope_freqs.weight)
    # yarn: the ramp's rotation bounds, whether its dimension range is rounded outwards, and the factor cos and sin
    # are multiplied by (resolved from the file as transformers resolves it)
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    attention_factor: float = 1.0


class _AttentionDims:
    """q/kv projection widths from the head counts (shared by the target and drafter configs)."""

    num_heads: int
    num_kv_heads: int
    head_dim: int

    @property
    def q_dim(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_dim


@dataclass(frozen=True)
class TargetConfig(_AttentionDims):
    arch: str  # "llama" | "qwen3"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 4096
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    name: str = "model"
    hidden_act: str = "silu"  # the MLP's gate activation (a name of HF_ACTIVATIONS)
    # per layer: the sliding attention window (a query at position p sees keys p-w+1..p), 0 = full causal
    # attention; () = every layer full
    layer_windows: tuple[int, ...] = ()

    @property
    def qk_norm(self) -> bool:
        return self.arch == "qwen3"

    def window(self, layer: int) -> int:
        return self.layer_windows[layer] if self.layer_windows else 0

    def validate(self) -> TargetConfig:
        if self.num_heads % self.num_kv_heads:
            raise CheckpointError(
                f"config: num_attention_heads={self.num_heads} is not a multiple of "
                f"num_key_value_heads={self.num_kv_heads}"
            )
        for f in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "head_dim"):
            if getattr(self, f) <= 0:
                raise CheckpointError(f"config: {f} must be positive, got {getattr(self, f)}")
        if self.hidden_act not in HF_ACTIVATIONS:
            raise CheckpointError(
                f"config: hidden_act {self.hidden_act!r} is not supported (supported: {', '.join(HF_ACTIVATIONS)})"
            )
        if self.layer_windows and len(self.layer_windows) != self.num_layers:
            raise CheckpointError(f"config: {len(self.layer_windows)} layer windows for {self.num_layers} layers")
        return self

    @staticmethod
    def from_hf(d: dict[str, Any], name: str = "model") -> TargetConfig:
        """A HF config.json (Llama, Mistral, Qwen3), read the way transformers reads it: fields it leaves out take
        the defaults of its config class; a field that changes the computation and that we do not compute is
        refused by name."""
        src = "config.json"
        archs = d.get("architectures") or []
        arch = None
        for a in archs:
            if a in SUPPORTED_TARGET_ARCHS:
                arch = SUPPORTED_TARGET_ARCHS[a]
        mt = d.get("model_type")
        if arch is None:
            if not archs and mt in HF_DEFAULTS:
                arch = "qwen3" if mt == "qwen3" else "llama"
            else:
                raise CheckpointError(
                    f"config.json: unsupported architecture {archs or mt!r}; supported: "
                    f"{', '.join(sorted(SUPPORTED_TARGET_ARCHS))}"
                )
        # transformers picks the config class (and so the defaults) by model_type
        family = mt if mt in HF_DEFAULTS else ("mistral" if "MistralForCausalLM" in archs else arch)
        defaults = HF_DEFAULTS[family]
        try:
            for f in HF_BIAS_FIELDS[family]:
                if d.get(f):
                    raise CheckpointError(
                        f"config.json: {f}: true (bias tensors in the {'attention' if 'attention' in f else 'MLP'} "
                        f"projections) is not supported; only checkpoints without biases load"
                    )
            hidden = int(d["hidden_size"])
            heads = int(d["num_attention_heads"])
            layers = int(d["num_hidden_layers"])
            eos = d.get("eos_token_id")
            eos_ids = tuple(eos) if isinstance(eos, list) else ((int(eos),) if eos is not None else ())
            kv = d.get("num_key_value_heads", defaults["num_key_value_heads"])
            head_dim = d.get("head_dim", defaults["head_dim"])
            max_pos = int(d.get("max_position_embeddings") or defaults["max_position_embeddings"])
            cfg = TargetConfig(
                arch=arch,
                vocab_size=int(d["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(d["intermediate_size"]),
                num_layers=layers,
                num_heads=heads,
                num_kv_heads=int(kv or heads),
                head_dim=int(head_dim or hidden // heads),
                rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
                **rope_fields(d, src, max_position_embeddings=max_pos),
                tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
                max_position_embeddings=max_pos,
                bos_token_id=d.get("bos_token_id"),
                eos_token_ids=eos_ids,
                name=name,
                hidden_act=str(d.get("hidden_act", "silu")),
                layer_windows=hf_layer_windows(d, family, layers, src),
            )
        except KeyError as e:
            raise CheckpointError(f"config.json: missing field {e.args[0]!r}") from None
        except (TypeError, ValueError) as e:
            raise CheckpointError(f"config.json: bad value ({e})") from None
        return cfg.validate()


def hf_layer_windows(d: dict[str, Any], family: str, num_layers: int, source: str) -> tuple[int, ...]:
    """Per-layer sliding windows (0 = full attention; () = all full), as transformers' model classes apply them:
    Llama has none; Mistral applies `sliding_window` (default 4096; null = none) to every layer; Qwen3 applies it
    (only with `use_sliding_window`) to the layers `layer_types` marks `sliding_attention`, by default the layers
    from `max_window_layers` on."""
    if family == "llama":
        return ()
    if family == "mistral":
        w = d.get("sliding_window", HF_DEFAULTS["mistral"]["sliding_window"])
        types = d.get("layer_types")
        if types is not None and set(types) != {FULL_ATTENTION if w is None else SLIDING_ATTENTION}:
            raise CheckpointError(
                f"{source}: layer_types is not supported for model_type 'mistral' (transformers' Mistral applies "
                f"sliding_window={w} to every layer and ignores layer_types)"
            )
        return () if w is None else (_window(w, "sliding_window", source),) * num_layers
    w = d.get("sliding_window", HF_DEFAULTS["qwen3"]["sliding_window"]) if d.get("use_sliding_window") else None
    types = d.get("layer_types")
    if types is None:
        first = int(d.get("max_window_layers", HF_DEFAULTS["qwen3"]["max_window_layers"]))
        types = [SLIDING_ATTENTION if w is not None and i >= first else FULL_ATTENTION for i in range(num_layers)]
    if not isinstance(types, list) or len(types) != num_layers:
        raise CheckpointError(f"{source}: layer_types must list one type per layer ({num_layers} layers), got {types}")
    for i, t in enumerate(types):
        if t not in (FULL_ATTENTION, SLIDING_ATTENTION):
            raise CheckpointError(
                f"{source}: layer_types[{i}] is {t!r}; supported: {FULL_ATTENTION!r}, {SLIDING_ATTENTION!r}"
            )
    if SLIDING_ATTENTION not in types:
        return ()
    if w is None:
        raise CheckpointError(
            f"{source}: layer_types marks layer {types.index(SLIDING_ATTENTION)} {SLIDING_ATTENTION!r} but no window "
            "is set (use_sliding_window is false or sliding_window is null)"
        )
    win = _window(w, "sliding_window", source)
    return tuple(win if t == SLIDING_ATTENTION else 0 for t in types)


def _window(w: Any, field_name: str, source: str) -> int:
    if isinstance(w, bool) or not isinstance(w, int) or w < 1:
        raise CheckpointError(f"{source}: {field_name} must be a positive integer, got {w!r}")
    return w


ROPE_TYPES = ("default", "linear", "llama3", "yarn")
# dflash-jax's own `rope_type` for per-frequency divisors (GGUF `rope_freqs.weight`), which transformers has no form
# for: written by the drafter export for a drafter trained on such a target, and read back by `rope_fields`.
FREQ_FACTORS = "freq_factors"


def rope_scaling_json(scaling: RopeScaling | None) -> dict[str, Any] | None:
    """A `RopeScaling` as transformers writes it in a config.json's `rope_scaling` (what `rope_fields` reads back
    to the same `RopeScaling`); None without scaling."""
    if scaling is None:
        return None
    if scaling.rope_type == "linear":
        return {"rope_type": "linear", "factor": scaling.factor}
    if scaling.rope_type == "llama3":
        return {
            "rope_type": "llama3",
            "factor": scaling.factor,
            "low_freq_factor": scaling.low_freq_factor,
            "high_freq_factor": scaling.high_freq_factor,
            "original_max_position_embeddings": scaling.original_max_position_embeddings,
        }
    if scaling.rope_type == "yarn":
        return {
            "rope_type": "yarn",
            "factor": scaling.factor,
            "original_max_position_embeddings": scaling.original_max_position_embeddings,
            "beta_fast": scaling.beta_fast,
            "beta_slow": scaling.beta_slow,
            "truncate": scaling.truncate,
            "attention_factor": scaling.attention_factor,
        }
    if scaling.rope_type == FREQ_FACTORS:
        return {"rope_type": FREQ_FACTORS, "freq_factors": list(scaling.freq_factors)}
    raise ValueError(f"rope_type {scaling.rope_type!r} has no config.json form")


def rope_fields(d: dict[str, Any], source: str, *, max_position_embeddings: int) -> dict[str, Any]:
    """`rope_theta` and `rope_scaling` (as TargetConfig / DrafterConfig fields) of a HF config dict, merged the way
    transformers does: the parameters are `rope_scaling` (older files) if set, else `rope_parameters`
    (transformers 5: `{rope_type, rope_theta, factor, ...}`); a `rope_theta` inside them wins over a top-level
    `rope_theta` (default 10000); for llama3, a top-level `original_max_position_embeddings` wins over the
    parameters' own, which default to `max_position_embeddings`. Refusals name the field the file uses."""
    field_name = "rope_scaling" if d.get("rope_scaling") else "rope_parameters"
    params = d.get(field_name) or {}
    if not isinstance(params, dict):
        raise CheckpointError(f"{source}: {field_name} must be an object, got {params!r}")
    nested = [k for k in params if k in (d.get("layer_types") or ())]
    if nested:
        raise CheckpointError(
            f"{source}: {field_name} is given per layer type ({', '.join(nested)}); only one RoPE for all layers "
            "is supported"
        )
    theta = params.get("rope_theta")
    if theta is None:
        theta = d.get("rope_theta")
    theta = 10000.0 if theta is None else theta
    kind_key = "rope_type" if "rope_type" in params or "type" not in params else "type"
    kind = params.get(kind_key, "default")
    partial = params.get("partial_rotary_factor", d.get("partial_rotary_factor"))

    def need(key: str) -> Any:
        if params.get(key) is None:
            raise CheckpointError(f"{source}: {field_name}.{key} is missing (rope_type {kind!r} needs it)")
        return params[key]

    try:
        if partial is not None and float(partial) != 1.0:
            where = "partial_rotary_factor"
            where = f"{field_name}.{where}" if where in params else where
            raise CheckpointError(f"{source}: {where} = {partial} (RoPE on part of each head) is not supported")
        if kind in (None, "default"):
            scaling = None
        elif kind == "linear":
            scaling = RopeScaling("linear", factor=float(need("factor")))
        elif kind == "llama3":
            orig = d.get("original_max_position_embeddings")
            if orig is None:
                orig = params.get("original_max_position_embeddings") or max_position_embeddings
            scaling = RopeScaling(
                "llama3",
                factor=float(need("factor")),
                low_freq_factor=float(need("low_freq_factor")),
                high_freq_factor=float(need("high_freq_factor")),
                original_max_position_embeddings=int(orig),
            )
        elif kind == "yarn":
            scaling = _yarn(d, params, max_position_embeddings)
        elif kind == FREQ_FACTORS:
            scaling = RopeScaling(FREQ_FACTORS, freq_factors=tuple(float(f) for f in need("freq_factors")))
        else:
            raise CheckpointError(
                f"{source}: {field_name}.{kind_key} {kind!r} is not supported (supported: {', '.join(ROPE_TYPES)})"
            )
        return {"rope_theta": float(theta), "rope_scaling": scaling}
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{source}: {field_name}: bad value ({e})") from None


def _yarn(d: dict[str, Any], params: dict[str, Any], max_position_embeddings: int) -> RopeScaling:
    """yarn's parameters resolved as transformers' `_compute_yarn_parameters` resolves them: a top-level
    `original_max_position_embeddings` wins (else the parameters', else max_position_embeddings); no `factor` =
    max_position_embeddings / original; no `attention_factor` = 0.1 ln(factor) + 1 (with `mscale` and
    `mscale_all_dim` both set: the ratio of that formula scaled by each)."""
    orig = d.get("original_max_position_embeddings")
    if orig is None:
        orig = params.get("original_max_position_embeddings") or max_position_embeddings
    factor = params.get("factor")
    factor = max_position_embeddings / orig if factor is None else float(factor)

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention = params.get("attention_factor")
    if attention is None:
        m, m_all = params.get("mscale"), params.get("mscale_all_dim")
        attention = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)
    return RopeScaling(
        "yarn",
        factor=factor,
        original_max_position_embeddings=int(orig),
        beta_fast=float(params.get("beta_fast") or 32),
        beta_slow=float(params.get("beta_slow") or 1),
        truncate=bool(params.get("truncate", True)),
        attention_factor=float(attention),
    )


@dataclass(frozen=True)
class DrafterConfig(_AttentionDims):
    """A DFlash drafter (z-lab `DFlashDraftModel` config.json)."""

    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    block_size: int
    mask_token_id: int
    target_layer_ids: tuple[int, ...]
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    # Per layer: (sliding window or 0 for none, causal inside the block?)
    layer_attn: tuple[tuple[int, bool], ...] = ()
    num_target_layers: int = 0
    arch: str = "dflash"
    # A verify width measured best for this drafter (config.json `dflash_jax_gamma`; 0 = none): the γ resolver
    # uses it instead of min(block + 2, 15) when --dflash-gamma is unset.
    measured_gamma: int = 0
    # DFlash2 only (arch == "dflash2", `DFlash2DraftModel`; models.drafter2): conv taps and channel group, selector
    conv_kernel_size: int = 2
    conv_group_size: int = 16
    selector_rank: int = 256
    selector_top_k: int = 16
    # z-lab `dflash_config` logit/embedding scalars (DFlash2 checkpoints set them; 1 / 0 / 1 = absent):
    # the selector's candidate logits are U = softcap(output_multiplier · logits) with softcap(x) = c·tanh(x/c)
    # (c = final_logit_softcapping, 0 = none), and the block's token embeddings are scaled by input_embedding_scale.
    output_multiplier: float = 1.0
    final_logit_softcapping: float = 0.0
    input_embedding_scale: float = 1.0
    extra: tuple[tuple[str, Any], ...] = field(default=(), compare=False)

    @property
    def num_taps(self) -> int:
        return len(self.target_layer_ids)


# the DrafterConfig scalars read from (and written to) a checkpoint's `dflash_config`; their defaults mean "absent"
DRAFTER_SCALARS = ("output_multiplier", "final_logit_softcapping", "input_embedding_scale")


def drafter_scalar_default(name: str) -> float:
    return DrafterConfig.__dataclass_fields__[name].default


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> tuple[int, ...]:
    """z-lab's default taps: one layer -> the middle; else spread evenly over [1, L-3], each rounded with Python's
    `round` (halves to even, so 62 target layers x 5 taps give 1, 16, 30, 44, 59)."""
    if num_draft_layers == 1:
        return (num_target_layers // 2,)
    span = num_target_layers - 4
    return tuple(round(1 + i * span / (num_draft_layers - 1)) for i in range(num_draft_layers))
