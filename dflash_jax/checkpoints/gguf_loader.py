"""GGUF (llama architecture) → our target weights, config and tokenizer.

Tensors are dequantized to f32 with the `gguf` package, one at a time as they are placed. llama.cpp permutes
the rows of Q and K for its RoPE kernel; we undo that to get the HF `rotate_half` layout.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import numpy as np

from dflash_jax.checkpoints.names import GGUF_NAME_MAP, map_name
from dflash_jax.config import RopeScaling, TargetConfig
from dflash_jax.errors import CheckpointError
from dflash_jax.models.layers import StoredTensor

ROPE_FREQS = "rope_freqs.weight"  # llama3-style RoPE scaling, stored as per-frequency divisors


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation ([out, in] layout)."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, -1).swapaxes(1, 2).reshape(w.shape)


def permute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's permutation (what a GGUF writer applies); the inverse of `unpermute_qk`."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, -1).swapaxes(1, 2).reshape(w.shape)


def read_fields(reader) -> dict[str, Any]:
    out = {}
    for k, f in reader.fields.items():
        if k.startswith("GGUF."):
            continue
        try:
            out[k] = f.contents()
        except Exception:  # a field type the gguf package cannot render; we do not need it
            continue
    return out


def load_gguf(path: Path):
    """Returns (TargetConfig, {canonical name: `StoredTensor` in [out, in] HF layout, dequantized to f32 when
    read}, tokenizer fields)."""
    from gguf import GGUFReader
    from gguf.quants import dequantize

    try:
        reader = GGUFReader(str(path))
    except Exception as e:
        raise CheckpointError(f"{path}: not a readable GGUF file ({e})") from None
    fields = read_fields(reader)
    arch = fields.get("general.architecture")
    if arch != "llama":
        raise CheckpointError(f"{path}: GGUF architecture {arch!r} is not supported (only 'llama')")

    def need(key):
        if key not in fields:
            raise CheckpointError(f"{path}: GGUF metadata field {key!r} is missing")
        return fields[key]

    n_head = int(need("llama.attention.head_count"))
    n_kv = int(fields.get("llama.attention.head_count_kv", n_head))
    hidden = int(need("llama.embedding_length"))
    vocab = len(need("tokenizer.ggml.tokens"))
    names = {t.name for t in reader.tensors}
    rs = None
    scaling_type = fields.get("llama.rope.scaling.type", "none")
    if scaling_type == "linear":
        rs = RopeScaling("linear", factor=float(need("llama.rope.scaling.factor")))
    elif scaling_type != "none":
        raise CheckpointError(
            f"{path}: GGUF metadata llama.rope.scaling.type {scaling_type!r} is not supported (supported: none, linear)"
        )
    eos = fields.get("tokenizer.ggml.eos_token_id")
    cfg = TargetConfig(
        arch="llama",
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=int(need("llama.feed_forward_length")),
        num_layers=int(need("llama.block_count")),
        num_heads=n_head,
        num_kv_heads=n_kv,
        head_dim=int(fields.get("llama.attention.key_length", hidden // n_head)),
        rms_norm_eps=float(fields.get("llama.attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(fields.get("llama.rope.freq_base", 10000.0)),
        rope_scaling=rs,
        tie_word_embeddings="output.weight" not in names,
        max_position_embeddings=int(fields.get("llama.context_length", 4096)),
        bos_token_id=fields.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=(int(eos),) if eos is not None else (),
        name=str(fields.get("general.name", path.stem)),
    ).validate()

    weights: dict[str, StoredTensor] = {}
    for t in reader.tensors:
        if t.name == ROPE_FREQS:
            factors = np.asarray(dequantize(t.data, t.tensor_type), np.float64).reshape(-1)
            if factors.size != cfg.head_dim // 2:
                raise CheckpointError(f"{path}: {ROPE_FREQS} has {factors.size} values, expected {cfg.head_dim // 2}")
            cfg = dataclasses.replace(
                cfg, rope_scaling=RopeScaling("freq_factors", freq_factors=tuple(float(f) for f in factors))
            )
            continue
        ours = map_name(t.name, GGUF_NAME_MAP)
        if ours is None:
            raise CheckpointError(f"{path}: unexpected GGUF tensor {t.name!r}")
        shape = tuple(int(x) for x in reversed(t.shape))
        heads = n_head if t.name.endswith("attn_q.weight") else n_kv if t.name.endswith("attn_k.weight") else None
        weights[ours] = StoredTensor(shape, "float32", _dequantizer(path, t, shape, heads))
    return cfg, weights, fields


def _dequantizer(path: Path, t, shape: tuple[int, ...], qk_heads: int | None):
    """`read()` for one GGUF tensor: dequantized to f32 from the memory-mapped file when it is placed (Q/K rows
    un-permuted with `qk_heads`)."""
    from gguf.quants import dequantize

    def read() -> np.ndarray:
        try:
            w = dequantize(t.data, t.tensor_type)
        except Exception as e:
            raise CheckpointError(f"{path}: cannot dequantize tensor {t.name!r} ({e})") from None
        w = np.asarray(w, dtype=np.float32).reshape(shape)
        return w if qk_heads is None else unpermute_qk(w, qk_heads)

    return read
