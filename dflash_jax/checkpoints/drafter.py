"""DFlash / DFlash2 drafter checkpoints: config.json parsing and validation, and loading a drafter directory
(z-lab safetensors, or a `dflash-jax quantize` output with quantized weights)."""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import numpy as np

from dflash_jax.checkpoints.hf import index_safetensors, read_json, safetensors_files
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
from dflash_jax.models.layers import (
    FUSED_MODULE,
    FUSED_PARTS,
    QUANTIZED_FUSED_AXES,
    DictBuilder,
    Placement,
    StoredTensor,
    fused_row_order,
)
from dflash_jax.quant import is_quantized, load_quantized, with_backend
from dflash_jax.quant.fuse import stack_rows

_log = logging.getLogger(__name__)

# config.json `architectures` -> DrafterConfig.arch
HF_ARCHS = {"DFlashDraftModel": "dflash", "DFlash2DraftModel": DFLASH2}
DRAFTER_ARCHS = tuple(HF_ARCHS)
# z-lab drafter configs are Qwen3 configs: a field they leave out has Qwen3Config's default
QWEN3_MAX_POS = HF_DEFAULTS["qwen3"]["max_position_embeddings"]
QWEN3_KV_HEADS = 32  # transformers' Qwen3Config default for num_key_value_heads
DFLASH2_DEFAULTS = {"conv_kernel_size": 2, "conv_group_size": 16, "selector_rank": 256, "selector_top_k": 16}


def hf_arch(cfg: DrafterConfig) -> str:
    """The config.json architecture name of a drafter config."""
    return next(name for name, arch in HF_ARCHS.items() if arch == cfg.arch)


# ------------------------------------------------------------------------------------------------ config.json
# `_attn_implementation` / `attn_implementation` values: the kernels z-lab's `dflash/model.py` runs its attention with
FLASH_KERNELS = ("flash_attention_2", "flash_attention_3")
PLAIN_KERNELS = ("sdpa", "eager")
QWEN3_WINDOW = 4096  # transformers' Qwen3Config `sliding_window` when config.json has none


def layer_types(d: dict[str, Any], n_layers: int, source: str) -> list[str]:
    """Per-layer attention types the way transformers' Qwen3Config (which loads every z-lab drafter config) builds
    them: `layer_types` if given, else `sliding_attention` for layers >= `max_window_layers` (default 28) when
    `use_sliding_window` is set."""
    types = d.get("layer_types")
    if types is None:
        start = int(d.get("max_window_layers", 28))
        sliding = bool(d.get("use_sliding_window")) and d.get("sliding_window", QWEN3_WINDOW) is not None
        types = ["sliding_attention" if sliding and i >= start else "full_attention" for i in range(n_layers)]
    if len(types) != n_layers:
        raise CheckpointError(f"{source}: layer_types has {len(types)} entries for {n_layers} layers")
    for t in types:
        if t not in ("full_attention", "sliding_attention"):
            raise CheckpointError(f"{source}: unknown layer type {t!r} in layer_types")
    return list(types)


def resolve_layer_attn(
    d: dict[str, Any], n_layers: int, source: str = "drafter config"
) -> tuple[tuple[int, bool], ...]:
    """Per-layer (window, causal). A window w (0 = none) lets a query see keys less than w positions away on
    either side (a causal layer sees none ahead of it anyway).

    Window: `sliding_window` (Qwen3Config's 4096 when absent) on `sliding_attention` layers, and only when
    `use_sliding_window` is true (transformers' Qwen3Config drops the window otherwise).
    Causality: `is_causal` if the config sets it (z-lab's later drafters, vLLM), else `dflash_config.causal`
    (vLLM's override), else non-causal when every layer is full attention (every reference agrees). Sliding layers
    without either field are run by z-lab's `dflash/model.py` non-causal, with the window only under flash attention
    (w-1 keys behind and ahead) and without it under sdpa/eager, while vLLM runs them causal: such a config is read
    the z-lab way when it names the kernel (`_attn_implementation` / `attn_implementation`) and refused otherwise.
    """
    types = layer_types(d, n_layers, source)
    use_window = bool(d.get("use_sliding_window"))
    raw_window = d.get("sliding_window", QWEN3_WINDOW)
    try:
        window = int(raw_window) if use_window and raw_window is not None else 0
    except (TypeError, ValueError):
        raise CheckpointError(f"{source}: sliding_window must be an integer, got {raw_window!r}") from None
    if raw_window is not None and use_window and window < 1 and "sliding_attention" in types:
        raise CheckpointError(
            f"{source}: sliding_window must be positive for sliding_attention layers, got {raw_window!r}"
        )
    explicit = d.get("is_causal")
    if explicit is None:
        explicit = (d.get("dflash_config") or {}).get("causal")
    if explicit is not None:
        return tuple((window if t == "sliding_attention" else 0, bool(explicit)) for t in types)
    if "sliding_attention" not in types:
        return tuple((0, False) for _ in types)
    kernel = d.get("_attn_implementation") or d.get("attn_implementation")
    if kernel in FLASH_KERNELS:
        return tuple((window if t == "sliding_attention" else 0, False) for t in types)
    if kernel in PLAIN_KERNELS:
        return tuple((0, False) for _ in types)
    layers = [i for i, t in enumerate(types) if t == "sliding_attention"]
    if kernel is not None:
        raise CheckpointError(
            f"{source}: attn_implementation {kernel!r} is not one of {', '.join(FLASH_KERNELS + PLAIN_KERNELS)}; "
            f"the sliding-window semantics of layers {layers} depend on it"
        )
    raise CheckpointError(
        f"{source}: layers {layers} are sliding_attention but the config sets neither is_causal nor "
        "dflash_config.causal, and references disagree on them (z-lab's dflash/model.py runs them non-causal, "
        "vLLM causal); set is_causal in config.json (false: non-causal, the window bounding both sides; true: causal)"
    )


def layer_attn_fields(cfg: DrafterConfig) -> dict[str, Any]:
    """The config.json fields that `resolve_layer_attn` reads back as `cfg.layer_attn`."""
    windows = {w for w, _ in cfg.layer_attn if w}
    causal = {c for _, c in cfg.layer_attn}
    if len(windows) > 1 or len(causal) > 1:
        raise CheckpointError(
            f"drafter layer attention {cfg.layer_attn} has no config.json form (one sliding_window and one "
            "is_causal for all layers)"
        )
    window = windows.pop() if windows else None
    return {
        "layer_types": ["sliding_attention" if w else "full_attention" for w, _ in cfg.layer_attn],
        "use_sliding_window": window is not None,
        "sliding_window": window,
        "is_causal": bool(causal.pop()) if causal else False,
    }


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


def check_supported_fields(d: dict[str, Any], source: str) -> None:
    """Refuse the Qwen3Config fields the drafter forward does not implement (the reference reads them)."""
    act = d.get("hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise CheckpointError(
            f"{source}: hidden_act {act!r} is not supported for the drafter (its MLP is SwiGLU: silu / swish)"
        )
    if d.get("attention_bias"):
        raise CheckpointError(
            f"{source}: attention_bias true (q/k/v/o projection biases) is not supported for the drafter"
        )
    sub = d.get("dflash_config") or {}
    for name in ("use_swa", "swa_window_size"):
        if sub.get(name) is not None:
            raise CheckpointError(
                f"{source}: dflash_config.{name} is not supported; give the window as layer_types, "
                "use_sliding_window and sliding_window"
            )


def drafter_head_dim(d: dict[str, Any], source: str) -> int:
    """`head_dim`, absent -> 128 as transformers' Qwen3Config (the reference's config class) defaults it."""
    if "head_dim" not in d:
        return 128
    raw = d["head_dim"]
    try:
        v = int(raw)
    except (TypeError, ValueError):
        raise CheckpointError(f"{source}: head_dim must be a positive integer, got {raw!r}") from None
    if v < 1:
        raise CheckpointError(f"{source}: head_dim must be a positive integer, got {raw!r}")
    return v


def drafter_kv_heads(d: dict[str, Any], heads: int, source: str) -> int:
    """`num_key_value_heads`, or Qwen3Config's default (32) where config.json leaves it out, as transformers and
    z-lab's model classes read it; a default that does not divide the head count is refused by name."""
    if d.get("num_key_value_heads") is not None:
        return int(d["num_key_value_heads"])
    kv = QWEN3_KV_HEADS
    if heads % kv:
        raise CheckpointError(
            f"{source}: config.json has no num_key_value_heads, so it is Qwen3Config's default {kv} (as transformers "
            f"reads it), which does not divide num_attention_heads={heads}; add num_key_value_heads to config.json"
        )
    return kv


def drafter_block_size(d: dict[str, Any], sub: dict[str, Any], source: str) -> int:
    """The block size: the top-level `block_size` (the field z-lab's model reads), else `dflash_config.block_size`,
    else 16; a config whose two fields disagree is refused naming both."""
    top, inner = d.get("block_size"), sub.get("block_size")
    if top is not None and inner is not None and int(top) != int(inner):
        raise CheckpointError(
            f"{source}: block_size={top} and dflash_config.block_size={inner} disagree; z-lab's model reads the "
            "top-level block_size: make them equal or remove dflash_config.block_size"
        )
    return int(top if top is not None else inner if inner is not None else 16)


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
    check_supported_fields(d, source)
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
            num_kv_heads=drafter_kv_heads(d, heads, source),
            head_dim=drafter_head_dim(d, source),
            vocab_size=int(d["vocab_size"]),
            block_size=drafter_block_size(d, sub, source),
            mask_token_id=int(sub["mask_token_id"]),
            target_layer_ids=tuple(int(i) for i in ids),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            **rope_fields(d, source, max_position_embeddings=int(d.get("max_position_embeddings") or QWEN3_MAX_POS)),
            layer_attn=resolve_layer_attn(d, n_layers, source),
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
def drafter_transposed(name: str) -> bool:
    """Whether a 2-D drafter tensor is a Linear weight, stored [out, in] in the files and [in, out] by us."""
    return not is_table(name)


def _placeholder(shape: tuple[int, ...]) -> StoredTensor:
    """A stand-in read as zeros, for a quantized weight that is set on the model after it is built."""
    return StoredTensor(shape, "float32", lambda: np.zeros(shape, np.float32))


def load_drafter(path: str | Path, tcfg: TargetConfig, dtype=jnp.float32) -> DrafterModel:
    """A z-lab DFlash drafter directory (or a `dflash-jax quantize` output; see `load_drafter_and_head`)."""
    return load_drafter_and_head(path, tcfg, dtype)[0]


def load_drafter_and_head(
    path: str | Path,
    tcfg: TargetConfig,
    dtype=jnp.float32,
    kernel_backend: str = "xla",
    placement: Placement | None = None,
):
    """(drafter, quantized LM-head copy or None). Tensors are read one at a time, placed per `placement` (default:
    the default device) and cast to `dtype` on the device. A checkpoint written by `dflash-jax quantize` keeps its
    quantized weights as they are (their matmuls on `kernel_backend`, see `quant.resolve_kernel_backend`) and may
    carry the drafter's quantized copy of the LM head."""
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
        raw: dict[str, Any] = {}
        for k, w in load_quantized(path).items():
            name = strip_model_prefix(k)
            if is_quantized(w):
                quantized[name] = with_backend(w, kernel_backend)
                raw[name] = _placeholder(tuple(w.shape))  # the declared [out, in] shape; replaced below
            else:
                raw[name] = np.asarray(w)
        head = quantized.pop("lm_head.weight", None)
        raw.pop("lm_head.weight", None)
    else:
        raw = {strip_model_prefix(k): w for k, w in index_safetensors(safetensors_files(path)).items()}
        head = None
    b = DictBuilder(raw, str(path), dtype, transposed=drafter_transposed, file_layout=True, placement=placement)
    m = drafter_class(cfg)(cfg, tcfg.hidden_size, b)
    b.check_all_used()
    set_quantized_weights(m, quantized, str(path))
    return m, head


_FUSED_PART = re.compile(r"^layers\.(\d+)\.(?:self_attn|mlp)\.(q|k|v|gate|up)_proj\.weight$")


def set_quantized_weights(model: DrafterModel, quantized: dict[str, Any], source: str) -> None:
    """Set a quantized checkpoint's weights (by z-lab name) on a built drafter. The parts of a fused projection
    (q/k/v, gate/up) are stacked into the fused weight (`quant.fuse.stack_rows`, in `layers.fused_row_order`):
    exactly, except NVFP4 parts with differing global scales, which are requantized with one global scale over
    the fused weight (logged; the drafts may move slightly, the output cannot: the target verifies every token).
    A fused projection must have all of its parts quantized, in one format."""
    groups: dict[tuple[int, str], dict[str, Any]] = {}
    for name, w in quantized.items():
        m = _FUSED_PART.match(name)
        if m is None:
            key_to_param(model, name).set_value(w)
            continue
        fused = "qkv_proj" if m[2] in ("q", "k", "v") else "gate_up_proj"
        groups.setdefault((int(m[1]), fused), {})[f"{m[2]}_proj"] = w
    for (i, fused), parts in sorted(groups.items()):
        names = {n: f"layers.{i}.{FUSED_MODULE[fused]}.{n}.weight" for n in FUSED_PARTS[fused]}
        missing = [names[n] for n in FUSED_PARTS[fused] if n not in parts]
        kinds = {type(w).__name__ for w in parts.values()}
        if missing or len(kinds) > 1:
            what = f"{missing[0]!r} is not quantized" if missing else f"its parts mix formats {sorted(kinds)}"
            raise CheckpointError(
                f"{source}: {', '.join(names.values())} are computed as one fused matmul, but {what}; "
                f"quantize them alike (re-run `dflash-jax quantize` on the unquantized drafter)"
            )
        w, exact = stack_rows([parts[n] for n in FUSED_PARTS[fused]], fused_row_order(fused, model.cfg))
        if not exact:
            _log.warning(
                "%s: %s have differing NVFP4 global scales; requantized as one fused weight with one global scale "
                "(drafts may differ slightly from the file's weights; output is verified by the target). Re-run "
                "`dflash-jax quantize` to write them with a shared global scale.",
                source,
                ", ".join(names.values()),
            )
        param = getattr(model.layers[i], fused)
        param.set_value(w)
        param.set_metadata(out_sharding=QUANTIZED_FUSED_AXES[fused])
