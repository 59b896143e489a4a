"""`--draft-weight-quantization declared|fp8|fp8-aux|nvfp4`: which drafter tensors get which format.

* `declared` (default) — keep the checkpoint's own weights.
* `fp8` — FP8-row for the seven per-layer GEMMs (q/k/v/o/gate/up/down) and the drafter's LM head
  (the model's fused `qkv_proj` and `gate_up_proj` are covered as their parts are).
* `fp8-aux` — `fp8` plus `fc`, the DFlash2 conv kernel projections and the candidate-selector projection
  (the context K/V projections are the per-layer k_proj / v_proj tensors, already covered).
* `nvfp4` — everything `fp8-aux` covers, in NVFP4.

Norms, embeddings, codebooks and anything else stay as declared. Names may carry a `model.` prefix.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp

from dflash_jax.errors import CheckpointError, UserError
from dflash_jax.quant.formats import is_quantized, quantize

TIERS = ("declared", "fp8", "fp8-aux", "nvfp4")
DEFAULT_TIER = "declared"
FLAG = "--draft-weight-quantization"


@functools.partial(jax.jit, static_argnums=1)
def _quantize_checked(w: jax.Array, fmt: str) -> tuple[Any, jax.Array]:
    return quantize(w, fmt), jnp.all(jnp.isfinite(w))


_PREFIX = r"^(?:model\.)?"
GEMM_PATTERNS = (
    re.compile(_PREFIX + r"layers\.\d+\.self_attn\.(?:[qkvo]|qkv)_proj\.weight$"),
    re.compile(_PREFIX + r"layers\.\d+\.mlp\.(?:gate|up|down|gate_up)_proj\.weight$"),
    re.compile(_PREFIX + r"lm_head\.weight$"),
)
AUX_PATTERNS = (
    re.compile(_PREFIX + r"fc\.weight$"),
    re.compile(_PREFIX + r"layers\.\d+\.(?:attention_conv|mlp_conv)\.kernel_projection\.weight$"),
    re.compile(_PREFIX + r"candidate_selector\.hidden_projection\.weight$"),
)


def parse_tier(value: str) -> str:
    """Validate a tier name (case-insensitive, `_` accepted for `-`); UserError naming the flag otherwise."""
    v = (value or "").strip().lower().replace("_", "-")
    if v not in TIERS:
        raise UserError(f"{FLAG} must be one of {', '.join(TIERS)}, got {value!r}", param=FLAG)
    return v


def tier_format(name: str, tier: str) -> str | None:
    """The format ("fp8" or "nvfp4") `tier` gives tensor `name`, or None when it stays as declared."""
    tier = parse_tier(tier)
    if tier == "declared":
        return None
    gemm = any(p.match(name) for p in GEMM_PATTERNS)
    aux = any(p.match(name) for p in AUX_PATTERNS)
    if tier == "fp8":
        return "fp8" if gemm else None
    if gemm or aux:
        return "fp8" if tier == "fp8-aux" else "nvfp4"
    return None


def quantize_drafter_weights(weights: Mapping[str, Any], tier: str) -> dict[str, Any]:
    """Quantize the tensors `tier` covers; everything else (and already-quantized tensors) passes through.

    A covered tensor must be 2-D `[N, K]` and finite, else CheckpointError naming it.
    """
    tier = parse_tier(tier)
    out: dict[str, Any] = {}
    for name, w in weights.items():
        fmt = None if is_quantized(w) else tier_format(name, tier)
        if fmt is None:
            out[name] = w
            continue
        if len(w.shape) != 2:
            raise CheckpointError(
                f"tensor {name!r} has shape {tuple(w.shape)}; {FLAG}={tier} needs a 2-D [out, in] weight",
                param=FLAG,
            )
        qw, finite = _quantize_checked(jnp.asarray(w), fmt)
        if not bool(finite):
            raise CheckpointError(f"tensor {name!r} has non-finite values; cannot quantize it", param=FLAG)
        out[name] = qw
    return out


def covered_names(names: Any, tier: str) -> dict[str, str]:
    """`{name: format}` for the names `tier` quantizes (for logs and tests)."""
    return {n: f for n in names if (f := tier_format(n, tier)) is not None}
