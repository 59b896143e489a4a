"""Export a drafter to z-lab's DFlash layout: `model.safetensors` (HF `[out, in]` matrices) + `config.json`."""

from __future__ import annotations

import json
from pathlib import Path

import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors.numpy import save_file

from dflash_jax.checkpoints.drafter import DFLASH2, dflash2_config_fields, hf_arch, layer_attn_fields
from dflash_jax.checkpoints.names import attr_to_key, is_table, key_to_param
from dflash_jax.config import DRAFTER_SCALARS, drafter_scalar_default, rope_scaling_json
from dflash_jax.models.drafter import DrafterModel
from dflash_jax.models.layers import (
    FUSED_MODULE,
    FUSED_PARTS,
    QUANTIZED_FUSED_AXES,
    fused_matrix,
    fused_part_rows,
    split_qkv,
)
from dflash_jax.quant import is_quantized, quantize_drafter_weights, with_backend
from dflash_jax.quant.fuse import take_rows


def drafter_state_dict(model: DrafterModel) -> dict[str, np.ndarray]:
    """The drafter's (unquantized) weights by z-lab key as f32 arrays in HF [out, in] layout."""
    return {k: np.asarray(w, np.float32) for k, w in drafter_weights_as_stored(model).items()}


def drafter_config_json(model: DrafterModel, target_num_layers: int) -> dict:
    """The drafter's config.json (a transformers `Qwen3Config` with the DFlash fields). RoPE scaling is written as
    transformers writes it (`rope_scaling`); per-frequency factors (a drafter trained on a GGUF Llama 3 target) as
    dflash-jax's `freq_factors` type, which this loader reads back and transformers does not know."""
    c = model.cfg
    rope = {} if c.rope_scaling is None else {"rope_scaling": rope_scaling_json(c.rope_scaling)}
    v2 = dflash2_config_fields(c) if c.arch == DFLASH2 else {}  # top level and in dflash_config
    scalars = {k: getattr(c, k) for k in DRAFTER_SCALARS if getattr(c, k) != drafter_scalar_default(k)}
    return {
        "architectures": [hf_arch(c)],
        **v2,
        "model_type": "qwen3",
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_hidden_layers": c.num_layers,
        "num_attention_heads": c.num_heads,
        "num_key_value_heads": c.num_kv_heads,
        "head_dim": c.head_dim,
        "vocab_size": c.vocab_size,
        "rms_norm_eps": c.rms_norm_eps,
        "rope_theta": c.rope_theta,
        **rope,
        "max_position_embeddings": 8192,
        "tie_word_embeddings": False,
        "hidden_act": "silu",
        "attention_bias": False,
        "block_size": c.block_size,
        "num_target_layers": target_num_layers,
        **layer_attn_fields(c),
        "torch_dtype": "float32",
        "dflash_config": {
            "target_layer_ids": list(c.target_layer_ids),
            "mask_token_id": c.mask_token_id,
            "block_size": c.block_size,
            **v2,
            **scalars,
        },
    }


def export_drafter(
    model: DrafterModel, out_dir: Path, target_num_layers: int, extra: dict | None = None, dtype=np.float32
) -> Path:
    """Write `model.safetensors` (in `dtype`: float32, or float16 to halve a committed file) and `config.json`."""
    out_dir.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.astype(dtype) for k, v in drafter_state_dict(model).items()}
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    cfg = drafter_config_json(model, target_num_layers)
    cfg["torch_dtype"] = np.dtype(dtype).name
    if extra:
        cfg.update(extra)
    (out_dir / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    return out_dir


def apply_weight_tier(model: DrafterModel, lm_head_in_out, tier: str, kernel_backend: str = "xla"):
    """Quantize the drafter's GEMM weights in place per `--draft-weight-quantization` tier; returns the drafter's
    copy of the LM head (quantized for every tier but `declared`, else the target's array as is). Every quantized
    weight's matmuls run on `kernel_backend` (see `quant.resolve_kernel_backend`). The fused q|k|v and gate|up are
    quantized fused (`models.layers.fused_matrix`): FP8 row scales are those of the separate tensors; NVFP4 has one
    global scale over the fused weight.

    The target keeps its own weights, so greedy output is unchanged by any tier; only the drafts move."""
    if tier == "declared":
        return lm_head_in_out
    weights = drafter_weights_fused(model)
    weights["lm_head.weight"] = jnp.asarray(lm_head_in_out).T  # [vocab, hidden] = [out, in], on the device
    quant = quantize_drafter_weights(weights, tier)
    head = lm_head_in_out
    for key, w in quant.items():
        if isinstance(w, jnp.ndarray | np.ndarray):
            continue  # not covered by this tier
        w = with_backend(w, kernel_backend)
        if key == "lm_head.weight":
            head = w
        else:
            param = key_to_param(model, key)
            param.set_value(w)
            fused = key.split(".")[-2]
            if fused in FUSED_PARTS:  # now an [out, in] weight: its logical axes as a quantized weight's
                param.set_metadata(out_sharding=QUANTIZED_FUSED_AXES[fused])
    return head


def _params(model: DrafterModel):
    """(module attribute path, its last name, value) of every parameter of the drafter."""
    for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        attr = ".".join(str(p) for p in path)
        yield attr, attr.split(".")[-1], var[...]


def drafter_weights_fused(model: DrafterModel) -> dict:
    """The drafter's weights in HF `[out, in]` layout on the device, with the fused q|k|v and gate|up under
    `layers.{i}.self_attn.qkv_proj.weight` / `layers.{i}.mlp.gate_up_proj.weight` as `[out, in]` matrices in
    their fused row order (the form `--draft-weight-quantization` quantizes them in)."""
    out = {}
    for attr, leaf, v in _params(model):
        if leaf in FUSED_PARTS:
            key = attr.rsplit(".", 1)[0] + f".{FUSED_MODULE[leaf]}.{leaf}.weight"
            out[key] = v if is_quantized(v) else fused_matrix(leaf, jnp.asarray(v, jnp.float32))
            continue
        key = attr_to_key(attr)
        if is_quantized(v):
            out[key] = v
        else:
            v = jnp.asarray(v, jnp.float32)
            out[key] = v.T if v.ndim == 2 and not is_table(key) else v
    return out


def drafter_weights_as_stored(model: DrafterModel) -> dict:
    """The drafter's weights by z-lab key: quantized weights as they are, arrays in HF [out, in] layout. The fused
    q|k|v and gate|up are split back into the checkpoint's tensors (exactly: rows move with their scales, and an
    NVFP4 part keeps the fused weight's global scale)."""
    out = {}
    for attr, leaf, v in _params(model):
        if leaf in FUSED_PARTS:
            layer = attr.rsplit(".", 1)[0]
            if is_quantized(v):
                parts = {n: take_rows(v, rows) for n, rows in fused_part_rows(leaf, model.cfg).items()}
            else:
                dense = np.asarray(v)
                split = split_qkv(dense) if leaf == "qkv_proj" else (dense[:, 0], dense[:, 1])
                parts = {n: np.ascontiguousarray(w.T) for n, w in zip(FUSED_PARTS[leaf], split, strict=True)}
            for n, w in parts.items():
                out[attr_to_key(f"{layer}.{n}")] = w
            continue
        key = attr_to_key(attr)  # module attribute path -> z-lab key
        if is_quantized(v):
            out[key] = v  # already [out, in]
        else:
            out[key] = np.ascontiguousarray(np.asarray(v).T) if v.ndim == 2 and not is_table(key) else np.asarray(v)
    return out
