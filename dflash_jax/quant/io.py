"""Save / load quantized drafter checkpoints as safetensors.

safetensors 0.8's numpy/flax front ends cannot look up the FP8 dtypes (`np.float8_e4m3fn` does not
exist), so this module reads and writes the format itself: 8-byte little-endian header
length, a JSON header `{name: {dtype, shape, data_offsets}, "__metadata__": {...}}` padded to 8 bytes, then
the raw little-endian bytes. FP8 tensors are written with their real dtype (`F8_E4M3`), so other readers
see ordinary tensors. Layout (ModelOpt-style names):

* plain tensor `name`                -> `name` (its own dtype)
* `Fp8RowWeight` at `name`           -> `name` F8_E4M3 [N, K], `name_scale` F32 [N]
* `Nvfp4Weight` at `name`            -> `name` U8 [N, Kp/2] (low nibble = even k), `name_scale` F8_E4M3
                                        [N, Kp/16], `name_scale_2` F32 [] (global scale)

`__metadata__["dflash_jax.quant"]` is JSON `{"version": 1, "tensors": {name: {"format": "fp8"} |
{"format": "nvfp4", "k": K}}}`; `__metadata__["dflash_jax.config"]` holds `config_extra` as JSON.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import ml_dtypes
import numpy as np

from dflash_jax.errors import CheckpointError
from dflash_jax.quant.formats import Fp8RowWeight, Nvfp4Weight

QUANT_KEY = "dflash_jax.quant"
CONFIG_KEY = "dflash_jax.config"
DEFAULT_FILENAME = "model.safetensors"

DTYPES: dict[str, np.dtype] = {
    "BOOL": np.dtype(np.bool_),
    "U8": np.dtype(np.uint8),
    "I8": np.dtype(np.int8),
    "U16": np.dtype(np.uint16),
    "I16": np.dtype(np.int16),
    "U32": np.dtype(np.uint32),
    "I32": np.dtype(np.int32),
    "U64": np.dtype(np.uint64),
    "I64": np.dtype(np.int64),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F32": np.dtype(np.float32),
    "F64": np.dtype(np.float64),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
    "F8_E8M0": np.dtype(ml_dtypes.float8_e8m0fnu),
}
_NAMES = {v: k for k, v in DTYPES.items()}


def _resolve(path: str | Path) -> Path:
    p = Path(path)
    return p / DEFAULT_FILENAME if p.is_dir() or p.suffix != ".safetensors" else p


def write_safetensors(path: str | Path, tensors: Mapping[str, Any], metadata: Mapping[str, str] | None = None) -> None:
    """Write numpy-convertible tensors (any dtype in `DTYPES`) to a .safetensors file."""
    header: dict[str, Any] = {}
    blobs: list[bytes] = []
    offset = 0
    for name in sorted(tensors):
        a = np.asarray(tensors[name])
        if not a.flags.c_contiguous:  # (np.ascontiguousarray would turn a scalar into shape [1])
            a = a.copy(order="C")
        if a.dtype not in _NAMES:
            raise ValueError(f"tensor {name!r}: dtype {a.dtype} cannot be stored in safetensors")
        data = a.astype(a.dtype.newbyteorder("<"), copy=False).tobytes()
        span = [offset, offset + len(data)]
        header[name] = {"dtype": _NAMES[a.dtype], "shape": list(a.shape), "data_offsets": span}
        blobs.append(data)
        offset += len(data)
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    hbytes = json.dumps(header, separators=(",", ":")).encode()
    hbytes += b" " * (-len(hbytes) % 8)
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_suffix(p.suffix + ".tmp")
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(hbytes)))
        f.write(hbytes)
        for b in blobs:
            f.write(b)
    tmp.replace(p)


def read_safetensors(path: str | Path) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """Read every tensor (numpy, memory-mapped) and the `__metadata__` of a .safetensors file."""
    p = Path(path)
    try:
        with open(p, "rb") as f:
            (hlen,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(hlen))
    except (OSError, struct.error, ValueError) as e:
        raise CheckpointError(f"{p}: not a readable safetensors file ({e})") from None
    meta = header.pop("__metadata__", None) or {}
    raw = np.memmap(p, dtype=np.uint8, mode="r", offset=8 + hlen) if header else np.zeros(0, np.uint8)
    out: dict[str, np.ndarray] = {}
    for name, info in header.items():
        if info["dtype"] not in DTYPES:
            raise CheckpointError(f"{p}: tensor {name!r} has unsupported dtype {info['dtype']}")
        dt = DTYPES[info["dtype"]].newbyteorder("<")
        b, e = info["data_offsets"]
        shape = tuple(info["shape"])
        if e - b != int(np.prod(shape, dtype=np.int64)) * dt.itemsize or e > raw.size:
            raise CheckpointError(f"{p}: tensor {name!r} has a byte range that does not match its shape")
        out[name] = raw[b:e].view(dt).reshape(shape)
    return out, dict(meta)


def save_quantized(path: str | Path, weights: Mapping[str, Any], config_extra: Mapping[str, Any] | None = None) -> Path:
    """Write a (partly) quantized drafter checkpoint. `path` is a .safetensors file or a directory
    (then `<dir>/model.safetensors`). Returns the file written."""
    tensors: dict[str, np.ndarray] = {}
    formats: dict[str, dict[str, Any]] = {}

    def put(key: str, value: Any) -> None:
        if key in tensors:
            raise ValueError(f"save_quantized: two tensors map to the name {key!r}")
        tensors[key] = np.asarray(value)

    for name, w in weights.items():
        if isinstance(w, Fp8RowWeight):
            put(name, w.q)
            put(name + "_scale", jnp.asarray(w.scale, jnp.float32))
            formats[name] = {"format": "fp8"}
        elif isinstance(w, Nvfp4Weight):
            put(name, jnp.asarray(w.packed, jnp.uint8))
            put(name + "_scale", w.block_scale)
            put(name + "_scale_2", jnp.asarray(w.global_scale, jnp.float32).reshape(()))
            formats[name] = {"format": "nvfp4", "k": int(w.k)}
        else:
            put(name, w)
    meta = {QUANT_KEY: json.dumps({"version": 1, "tensors": formats}, sort_keys=True)}
    if config_extra is not None:
        meta[CONFIG_KEY] = json.dumps(dict(config_extra), sort_keys=True)
    out = _resolve(path)
    write_safetensors(out, tensors, meta)
    return out


def read_quantized_config(path: str | Path) -> dict[str, Any]:
    """The `config_extra` stored by `save_quantized` ({} when absent)."""
    _, meta = read_safetensors(_resolve(path))
    return json.loads(meta[CONFIG_KEY]) if CONFIG_KEY in meta else {}


def load_quantized(path: str | Path) -> dict[str, Any]:
    """Load a checkpoint written by `save_quantized` (or any plain safetensors file) as jax arrays and
    quantized weights, keyed by the original tensor names."""
    p = _resolve(path)
    arrays, meta = read_safetensors(p)
    try:
        info = json.loads(meta.get(QUANT_KEY, '{"tensors": {}}'))["tensors"]
    except (ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{p}: bad {QUANT_KEY} metadata ({e})") from None
    used: set[str] = set()

    def take(key: str, dtype: np.dtype, ndim: int) -> jnp.ndarray:
        if key not in arrays:
            raise CheckpointError(f"{p}: missing tensor {key!r} of a quantized weight")
        a = arrays[key]
        if a.dtype != dtype or a.ndim != ndim:
            raise CheckpointError(f"{p}: tensor {key!r} is {a.dtype}{list(a.shape)}, expected {dtype} of rank {ndim}")
        used.add(key)
        return jnp.asarray(np.array(a))

    out: dict[str, Any] = {}
    for name, fmt in info.items():
        kind = fmt.get("format")
        if kind == "fp8":
            q = take(name, DTYPES["F8_E4M3"], 2)
            w: Any = Fp8RowWeight(q=q, scale=take(name + "_scale", DTYPES["F32"], 1))
            if w.scale.shape[0] != w.q.shape[0]:
                raise CheckpointError(f"{p}: {name!r} has {w.q.shape[0]} rows but {w.scale.shape[0]} scales")
        elif kind == "nvfp4":
            packed = take(name, DTYPES["U8"], 2)
            bs = take(name + "_scale", DTYPES["F8_E4M3"], 2)
            g = take(name + "_scale_2", DTYPES["F32"], 0)
            k = int(fmt["k"])
            kp = 2 * packed.shape[1]
            if bs.shape != (packed.shape[0], kp // 16) or not (kp - 16 < k <= kp):
                raise CheckpointError(f"{p}: NVFP4 tensor {name!r} has inconsistent shapes")
            w = Nvfp4Weight(packed=packed, block_scale=bs, global_scale=g, k=k)
        else:
            raise CheckpointError(f"{p}: tensor {name!r} has unknown quantized format {kind!r}")
        out[name] = w
    for name, a in arrays.items():
        if name not in used:
            out[name] = jnp.asarray(np.array(a))
    return out
