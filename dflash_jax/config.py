"""Frozen configuration dataclasses, built once from checkpoint JSON/metadata and CLI flags.

They are hashable so jitted step functions can take them as static arguments.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from dflash_jax.errors import CheckpointError

SUPPORTED_TARGET_ARCHS = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "Qwen3ForCausalLM": "qwen3",
}


@dataclass(frozen=True)
class RopeScaling:
    """`rope_scaling` of HF configs. Supported: `llama3` (Llama 3.1+) and `linear`."""

    rope_type: str
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    freq_factors: tuple[float, ...] = ()  # `freq_factors`: per-frequency divisors (GGUF rope_freqs.weight)


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

    @property
    def qk_norm(self) -> bool:
        return self.arch == "qwen3"

    def validate(self) -> TargetConfig:
        if self.num_heads % self.num_kv_heads:
            raise CheckpointError(
                f"config: num_attention_heads={self.num_heads} is not a multiple of "
                f"num_key_value_heads={self.num_kv_heads}"
            )
        for f in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "head_dim"):
            if getattr(self, f) <= 0:
                raise CheckpointError(f"config: {f} must be positive, got {getattr(self, f)}")
        return self

    @staticmethod
    def from_hf(d: dict[str, Any], name: str = "model") -> TargetConfig:
        archs = d.get("architectures") or []
        arch = None
        for a in archs:
            if a in SUPPORTED_TARGET_ARCHS:
                arch = SUPPORTED_TARGET_ARCHS[a]
        if arch is None:
            mt = d.get("model_type")
            if not archs and mt in ("llama", "qwen3", "mistral"):
                arch = "qwen3" if mt == "qwen3" else "llama"
            else:
                raise CheckpointError(
                    f"config.json: unsupported architecture {archs or mt!r}; supported: "
                    f"{', '.join(sorted(SUPPORTED_TARGET_ARCHS))}"
                )
        try:
            hidden = int(d["hidden_size"])
            heads = int(d["num_attention_heads"])
            eos = d.get("eos_token_id")
            eos_ids = tuple(eos) if isinstance(eos, list) else ((int(eos),) if eos is not None else ())
            rs = d.get("rope_scaling") or None
            rope_theta = d.get("rope_theta")
            if rope_theta is None and isinstance(d.get("rope_parameters"), dict):
                rope_theta = d["rope_parameters"].get("rope_theta")
                if rs is None and d["rope_parameters"].get("rope_type", "default") != "default":
                    rs = d["rope_parameters"]
            cfg = TargetConfig(
                arch=arch,
                vocab_size=int(d["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(d["intermediate_size"]),
                num_layers=int(d["num_hidden_layers"]),
                num_heads=heads,
                num_kv_heads=int(d.get("num_key_value_heads") or heads),
                head_dim=int(d.get("head_dim") or hidden // heads),
                rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
                rope_theta=float(rope_theta if rope_theta is not None else 10000.0),
                rope_scaling=parse_rope_scaling(rs),
                tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
                max_position_embeddings=int(d.get("max_position_embeddings", 4096)),
                bos_token_id=d.get("bos_token_id"),
                eos_token_ids=eos_ids,
                name=name,
            )
        except KeyError as e:
            raise CheckpointError(f"config.json: missing field {e.args[0]!r}") from None
        except (TypeError, ValueError) as e:
            raise CheckpointError(f"config.json: bad value ({e})") from None
        return cfg.validate()


def parse_rope_scaling(rs: dict[str, Any] | None) -> RopeScaling | None:
    if not rs:
        return None
    kind = rs.get("rope_type", rs.get("type"))
    if kind in (None, "default"):
        return None
    if kind == "llama3":
        return RopeScaling(
            "llama3",
            factor=float(rs["factor"]),
            low_freq_factor=float(rs.get("low_freq_factor", 1.0)),
            high_freq_factor=float(rs.get("high_freq_factor", 4.0)),
            original_max_position_embeddings=int(rs.get("original_max_position_embeddings", 8192)),
        )
    if kind == "linear":
        return RopeScaling("linear", factor=float(rs["factor"]))
    raise CheckpointError(
        f"config.json: rope_scaling type {kind!r} is not supported (supported: llama3, linear, default)"
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
