"""DFlash / DFlash2 drafter checkpoints: config.json parsing and validation, and loading a drafter directory
(z-lab safetensors, or a `dflash-jax quantize` output with quantized weights)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax.numpy as jnp
import numpy as np

from dflash_jax.checkpoints.hf import read_json, read_safetensors, safetensors_files
from dflash_jax.checkpoints.names import is_table, key_to_param, strip_model_prefix
from dflash_jax.config import (
    DRAFTER_SCALARS,
    HF_DEFAULTS,
    DrafterConfig,
    TargetConfig,
    default_target_layer_ids,
    drafter_scalar_default,
    rope_fields,
)
from dflash_jax.errors import CheckpointError
from dflash_jax.models.drafter import DrafterModel
from dflash_jax.models.drafter2 import ARCH as DFLASH2
from dflash_jax.models.drafter2 import drafter_class
from dflash_jax.models.layers import DictBuilder
from dflash_jax.quant import is_quantized, load_quantized, with_backend

# config.json `architectures` -> DrafterConfig.arch
HF_ARCHS = {"DFlashDraftModel": "dflash", "DFlash2DraftModel": DFLASH2}
DRAFTER_ARCHS = tuple(HF_ARCHS)
# z-lab drafter configs are Qwen3 configs: a field they leave out has Qwen3Config's default
QWEN3_MAX_POS = HF_DEFAULTS["qwen3"]["max_position_embeddings"]
DFLASH2_DEFAULTS = {"conv_kernel_size": 2, "conv_group_size": 16, "selector_rank": 256, "selector_top_k": 16}


def hf_arch(cfg: DrafterConfig) -> str:
    """The config.json architecture name of a drafter config."""
    return next(name for name, arch in HF_ARCHS.items() if arch == cfg.arch)


# ------------------------------------------------------------------------------------------------ config.json
def resolve_layer_attn(d: dict[str, Any], n_layers: int) -> tuple[tuple[int, bool], ...]:
    """Per-layer (window, causal), resolved the way vLLM does: explicit `is_causal`, then
    `dflash_config.causal`, then sliding ⇒ causal, full ⇒ non-causal."""
    types = d.get("layer_types") or ["full_attention"] * n_layers
    if len(types) != n_layers:
        raise CheckpointError(f"drafter config: layer_types has {len(types)} entries for {n_layers} layers")
    window = int(d.get("sliding_window") or 0)
    if d.get("use_sliding_window") is False and "layer_types" not in d:
        window = 0
    explicit = d.get("is_causal")
    sub = (d.get("dflash_config") or {}).get("causal")
    out = []
    for t in types:
        if t not in ("full_attention", "sliding_attention"):
            raise CheckpointError(f"drafter config: unknown layer type {t!r}")
        sliding = t == "sliding_attention"
        if explicit is not None:
            causal = bool(explicit)
        elif sub is not None:
            causal = bool(sub)
        else:
            causal = sliding
        out.append((window if sliding else 0, causal))
    return tuple(out)


def logit_scalars(d: dict, sub: dict, source: str) -> dict[str, float]:
    """`output_multiplier`, `final_logit_softcapping`, `input_embedding_scale` (dflash_config or top level)."""
    out = {}
    for name in DRAFTER_SCALARS:
        zero_ok = name == "final_logit_softcapping"  # 0 = no softcap
        raw = sub.get(name, d.get(name))
        try:
            out[name] = drafter_scalar_default(name) if raw is None else float(raw)
        except (TypeError, ValueError):
            raise CheckpointError(f"{source}: {name} must be a number, got {raw!r}") from None
        v = out[name]
        if not np.isfinite(v) or v < 0 or (v == 0 and not zero_ok):
            bound = "non-negative (0 = none)" if zero_ok else "positive"
            raise CheckpointError(f"{source}: {name} must be {bound} and finite, got {raw!r}")
    return out


def dflash2_fields(d: dict[str, Any], hidden: int, vocab: int, source: str) -> dict[str, int]:
    """The DFlash2 conv and selector fields of a config.json (in `dflash_config` or at the top level), validated."""
    sub = d.get("dflash_config") or {}
    out = {}
    for name, default in DFLASH2_DEFAULTS.items():
        raw = sub.get(name, d.get(name, default))
        try:
            out[name] = int(raw)
        except (TypeError, ValueError):
            raise CheckpointError(f"{source}: {name} must be an integer, got {raw!r}") from None
        if out[name] < 1:
            raise CheckpointError(f"{source}: {name} must be positive, got {out[name]}")
    if hidden % out["conv_group_size"]:
        raise CheckpointError(
            f"{source}: conv_group_size {out['conv_group_size']} does not divide hidden_size {hidden}"
        )
    if out["selector_top_k"] > vocab:
        raise CheckpointError(f"{source}: selector_top_k {out['selector_top_k']} exceeds vocab_size {vocab}")
    return out


def dflash2_config_fields(cfg: DrafterConfig) -> dict[str, int]:
    """The DFlash2 fields a config.json carries (the inverse of `dflash2_fields`)."""
    return {name: getattr(cfg, name) for name in DFLASH2_DEFAULTS}


def drafter_config_from_hf(d: dict[str, Any], source: str) -> DrafterConfig:
    archs = d.get("architectures") or []
    arch = next((HF_ARCHS[a] for a in archs if a in HF_ARCHS), None)
    if arch is None:
        raise CheckpointError(
            f"{source}: architectures {archs} is not a DFlash drafter (expected one of {', '.join(DRAFTER_ARCHS)})"
        )
    sub = d.get("dflash_config") or {}
    if "mask_token_id" not in sub:
        raise CheckpointError(f"{source}: config.json has no dflash_config.mask_token_id")
    try:
        n_layers = int(d["num_hidden_layers"])
        hidden = int(d["hidden_size"])
        heads = int(d["num_attention_heads"])
        ids = sub.get("target_layer_ids")
        n_target = int(d.get("num_target_layers", 0))
        if not ids:
            if not n_target:
                raise CheckpointError(f"{source}: no dflash_config.target_layer_ids and no num_target_layers")
            ids = default_target_layer_ids(n_target, n_layers)
        v2 = {}
        if "DFlash2DraftModel" in archs:
            v2 = dict(arch=DFLASH2, **dflash2_fields(d, hidden, int(d["vocab_size"]), source))
        return DrafterConfig(
            hidden_size=hidden,
            intermediate_size=int(d["intermediate_size"]),
            num_layers=n_layers,
            num_heads=heads,
            num_kv_heads=int(d.get("num_key_value_heads") or heads),
            head_dim=int(d.get("head_dim") or hidden // heads),
            vocab_size=int(d["vocab_size"]),
            block_size=int(sub.get("block_size") or d.get("block_size") or 16),
            mask_token_id=int(sub["mask_token_id"]),
            target_layer_ids=tuple(int(i) for i in ids),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            **rope_fields(d, source, max_position_embeddings=int(d.get("max_position_embeddings") or QWEN3_MAX_POS)),
            layer_attn=resolve_layer_attn(d, n_layers),
            num_target_layers=n_target,
            measured_gamma=int(d.get("dflash_jax_gamma") or 0),
            **logit_scalars(d, sub, source),
            **v2,
        )
    except KeyError as e:
        raise CheckpointError(f"{source}: config.json is missing field {e.args[0]!r}") from None


def check_against_target(cfg: DrafterConfig, tcfg: TargetConfig, source: str) -> None:
    if cfg.hidden_size != tcfg.hidden_size:
        raise CheckpointError(
            f"{source}: drafter hidden_size {cfg.hidden_size} differs from the target's hidden_size "
            f"{tcfg.hidden_size}; the drafter shares the target's embedding and LM head, so they must match"
        )
    if not 0 <= cfg.mask_token_id < tcfg.vocab_size:
        raise CheckpointError(
            f"{source}: dflash_config.mask_token_id {cfg.mask_token_id} is outside the target vocabulary "
            f"(0..{tcfg.vocab_size - 1})"
        )
    for i in cfg.target_layer_ids:
        if not 0 <= i < tcfg.num_layers:
            raise CheckpointError(
                f"{source}: dflash_config.target_layer_ids contains {i}, but the target has {tcfg.num_layers} "
                f"layers (ids are 0-based decoder-layer outputs)"
            )


# ------------------------------------------------------------------------------------------------ weights
def drafter_weights_to_ours(raw: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Strip the optional `model.` prefix and transpose matrices to our [in, out] layout."""
    out = {}
    for k, w in raw.items():
        name = strip_model_prefix(k)
        out[name] = np.ascontiguousarray(w.T) if w.ndim == 2 and not is_table(name) else w
    return out


def load_drafter(path: str | Path, tcfg: TargetConfig, dtype=jnp.float32) -> DrafterModel:
    """A z-lab DFlash drafter directory (or a `dflash-jax quantize` output; see `load_drafter_and_head`)."""
    return load_drafter_and_head(path, tcfg, dtype)[0]


def load_drafter_and_head(path: str | Path, tcfg: TargetConfig, dtype=jnp.float32, kernel_backend: str = "xla"):
    """(drafter, quantized LM-head copy or None). A checkpoint written by `dflash-jax quantize` keeps its quantized
    weights as they are (their matmuls on `kernel_backend`, see `quant.resolve_kernel_backend`) and may carry the
    drafter's quantized copy of the LM head."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"--draft-model: path {str(path)!r} does not exist")
    if not (path / "config.json").exists():
        raise CheckpointError(f"--draft-model: {path} has no config.json (not a DFlash drafter directory)")
    raw_cfg = read_json(path / "config.json")
    cfg = drafter_config_from_hf(raw_cfg, str(path))
    check_against_target(cfg, tcfg, str(path))
    quantized: dict[str, Any] = {}
    if raw_cfg.get("dflash_jax_quantization"):
        raw = {}
        for k, w in load_quantized(path).items():
            name = strip_model_prefix(k)
            if is_quantized(w):
                quantized[name] = with_backend(w, kernel_backend)
                raw[name] = np.zeros(w.shape, np.float32)  # placeholder with the declared [out, in] shape
            else:
                raw[name] = np.asarray(w, np.float32)
        head = quantized.pop("lm_head.weight", None)
        raw.pop("lm_head.weight", None)
    else:
        raw, head = read_safetensors(safetensors_files(path)), None
    b = DictBuilder(drafter_weights_to_ours(raw), str(path), dtype)
    m = drafter_class(cfg)(cfg, tcfg.hidden_size, b)
    b.check_all_used()
    for name, w in quantized.items():
        key_to_param(m, name).set_value(w)
    return m, head
