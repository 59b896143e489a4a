"""Hugging Face checkpoint directories: config.json + single or sharded *.safetensors (+ index)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import ml_dtypes  # noqa: F401  (registers bfloat16 with numpy, for bf16 tensors)
import numpy as np
from safetensors import safe_open

from dflash_jax.errors import CheckpointError
from dflash_jax.models.layers import StoredTensor


def read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{path.parent}: no {path.name} (is this a model directory?)") from None
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path}: invalid JSON ({e})") from None


def safetensors_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.exists():
        wm = read_json(index).get("weight_map")
        if not isinstance(wm, dict):
            raise CheckpointError(f"{index}: no 'weight_map'")
        files = sorted({path / f for f in wm.values()})
        for f in files:
            if not f.exists():
                raise CheckpointError(f"{index}: shard {f.name} is listed but missing")
        return files
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{path}: no *.safetensors weights found")
    return files


def _unreadable(f: Path, e: Exception) -> CheckpointError:
    msg = str(e).splitlines()[0] if str(e) else type(e).__name__
    return CheckpointError(f"{f}: corrupt or unreadable safetensors file ({msg})")


def _reader(f: Path, name: str):
    """`read()` for one tensor: opens the (memory-mapped) file, copies that tensor out in its stored dtype
    (bfloat16 as `ml_dtypes.bfloat16`) and closes the file again, so the host holds one tensor at a time."""

    def read() -> np.ndarray:
        try:
            with safe_open(str(f), framework="numpy") as sf:
                return sf.get_tensor(name)
        except Exception as e:  # safetensors raises SafetensorError / OSError on corrupt files
            raise _unreadable(f, e) from None

    return read


def index_safetensors(files: list[Path], strip_prefix: str = "") -> dict[str, StoredTensor]:
    """Every tensor of the files, by name with `strip_prefix` removed, as a `StoredTensor` (shape and dtype from
    the headers; the data is read when the tensor is placed)."""
    out: dict[str, StoredTensor] = {}
    for f in files:
        try:
            with safe_open(str(f), framework="numpy") as sf:
                for name in sf.keys():
                    sl = sf.get_slice(name)
                    key = name[len(strip_prefix) :] if strip_prefix and name.startswith(strip_prefix) else name
                    if key in out:
                        raise CheckpointError(f"{f}: tensor {name!r} appears in more than one shard")
                    shape = tuple(int(d) for d in sl.get_shape())
                    out[key] = StoredTensor(shape, str(sl.get_dtype()), _reader(f, name))
        except CheckpointError:
            raise
        except Exception as e:
            raise _unreadable(f, e) from None
    return out
