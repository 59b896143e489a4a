"""Tensor names: checkpoint file names <-> our parameter names <-> module attributes, in one place.

Our parameter names are the HF/z-lab ones without the `model.` prefix (`layers.{i}.self_attn.q_proj.weight`);
`{i}` in a map stands for a layer index. The drafter's module attributes drop the `self_attn` / `mlp` / `weight`
parts (`layers.0.q_proj`); `attr_to_key` and `key_to_param` translate between the two.
"""

from __future__ import annotations

import re
from typing import Any

# HF Llama/Qwen3 target checkpoints: HF name -> our name.
HF_NAME_MAP: dict[str, str] = {
    "model.embed_tokens.weight": "embed_tokens.weight",
    "model.norm.weight": "norm.weight",
    "lm_head.weight": "lm_head.weight",
    "model.layers.{i}.input_layernorm.weight": "layers.{i}.input_layernorm.weight",
    "model.layers.{i}.post_attention_layernorm.weight": "layers.{i}.post_attention_layernorm.weight",
    "model.layers.{i}.self_attn.q_proj.weight": "layers.{i}.self_attn.q_proj.weight",
    "model.layers.{i}.self_attn.k_proj.weight": "layers.{i}.self_attn.k_proj.weight",
    "model.layers.{i}.self_attn.v_proj.weight": "layers.{i}.self_attn.v_proj.weight",
    "model.layers.{i}.self_attn.o_proj.weight": "layers.{i}.self_attn.o_proj.weight",
    "model.layers.{i}.self_attn.q_norm.weight": "layers.{i}.self_attn.q_norm.weight",
    "model.layers.{i}.self_attn.k_norm.weight": "layers.{i}.self_attn.k_norm.weight",
    "model.layers.{i}.mlp.gate_proj.weight": "layers.{i}.mlp.gate_proj.weight",
    "model.layers.{i}.mlp.up_proj.weight": "layers.{i}.mlp.up_proj.weight",
    "model.layers.{i}.mlp.down_proj.weight": "layers.{i}.mlp.down_proj.weight",
}

# GGUF (llama architecture) target files: GGUF name -> our name.
GGUF_NAME_MAP: dict[str, str] = {
    "token_embd.weight": "embed_tokens.weight",
    "output_norm.weight": "norm.weight",
    "output.weight": "lm_head.weight",
    "blk.{i}.attn_norm.weight": "layers.{i}.input_layernorm.weight",
    "blk.{i}.attn_q.weight": "layers.{i}.self_attn.q_proj.weight",
    "blk.{i}.attn_k.weight": "layers.{i}.self_attn.k_proj.weight",
    "blk.{i}.attn_v.weight": "layers.{i}.self_attn.v_proj.weight",
    "blk.{i}.attn_output.weight": "layers.{i}.self_attn.o_proj.weight",
    "blk.{i}.ffn_norm.weight": "layers.{i}.post_attention_layernorm.weight",
    "blk.{i}.ffn_gate.weight": "layers.{i}.mlp.gate_proj.weight",
    "blk.{i}.ffn_up.weight": "layers.{i}.mlp.up_proj.weight",
    "blk.{i}.ffn_down.weight": "layers.{i}.mlp.down_proj.weight",
}

# Target tensors stored [rows, dim] in both layouts (not transposed from the files' [out, in]).
NOT_TRANSPOSED = {"embed_tokens.weight"}

_LAYER_INDEX = re.compile(r"\.(\d+)\.")


def map_name(name: str, name_map: dict[str, str]) -> str | None:
    """A checkpoint tensor name -> our name through `name_map` (None for a name it does not list)."""
    if name in name_map:
        return name_map[name]
    m = _LAYER_INDEX.search(name)
    if m:
        key = f"{name[: m.start()]}.{{i}}.{name[m.end() :]}"
        if key in name_map:
            return name_map[key].replace("{i}", m.group(1))
    return None


def file_names_for(name_map: dict[str, str], num_layers: int) -> dict[str, str]:
    """Our name -> the checkpoint's name, from a format's name map (for error messages)."""
    out = {}
    for theirs, ours in name_map.items():
        if "{i}" in theirs:
            for i in range(num_layers):
                out[ours.replace("{i}", str(i))] = theirs.replace("{i}", str(i))
        else:
            out[ours] = theirs
    return out


# ------------------------------------------------------------------------------------------------ drafter
_ATTN = {"q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm"}
_MLP = {"gate_proj", "up_proj", "down_proj"}
_RAW = {"base_kernel", "predecessor_codebook", "successor_codebook"}  # DFlash2 tensors without a `.weight` suffix
_SKIPPED = {"self_attn", "mlp", "weight"}  # key parts that name no module attribute


def strip_model_prefix(name: str) -> str:
    """A drafter file's tensor name without its optional `model.` prefix (our name)."""
    return name[len("model.") :] if name.startswith("model.") else name


def is_table(name: str) -> bool:
    """A 2-D drafter tensor stored [rows, dim] in both layouts (not a Linear weight): the DFlash2 selector
    codebooks."""
    return name.endswith("_codebook")


def attr_to_key(attr: str) -> str:
    """A drafter module attribute path (`layers.0.q_proj`) -> its z-lab tensor name (`layers.0.self_attn.q_proj
    .weight`)."""
    parts = attr.split(".")
    if parts[-1] in _RAW:  # DFlash2 conv base kernels, selector codebooks
        return attr
    if len(parts) > (3 if parts[0] == "layers" else 1):  # DFlash2 submodule Linears (kernel/hidden projection)
        return attr + ".weight"
    if parts[0] == "layers":
        i, leaf = parts[1], parts[2]
        if leaf in _ATTN:
            return f"layers.{i}.self_attn.{leaf}.weight"
        if leaf in _MLP:
            return f"layers.{i}.mlp.{leaf}.weight"
        return f"layers.{i}.{leaf}.weight"
    return f"{parts[0]}.weight"


def key_to_param(model: Any, key: str) -> Any:
    """The `nnx.Param` of a drafter's z-lab tensor name (the inverse of `attr_to_key`)."""
    obj = model
    for part in key.split("."):
        if part in _SKIPPED:
            continue
        obj = obj[int(part)] if part.isdigit() else getattr(obj, part)
    return obj
