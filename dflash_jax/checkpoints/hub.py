"""Model names as users type them: `--model` / `--draft-model` take a local path or a Hugging Face Hub repo id
(`Qwen/Qwen3-8B`, `z-lab/Qwen3-8B-DFlash-b16`), resolved with huggingface_hub the way vLLM resolves them: a path
that exists wins; a repo id is looked up in the local Hugging Face cache (`HF_HUB_CACHE`, `HF_HOME`) first, then
downloaded when the host is online (not under `HF_HUB_OFFLINE=1`); when neither works the error names the id."""

from __future__ import annotations

from pathlib import Path

from huggingface_hub import constants, snapshot_download
from huggingface_hub.errors import (
    GatedRepoError,
    HFValidationError,
    LocalEntryNotFoundError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)
from huggingface_hub.utils import validate_repo_id

from dflash_jax.errors import UserError

# What a model directory needs: config, tokenizer files and safetensors weights (not .bin/.pth/.gguf duplicates).
MODEL_FILES = ["*.json", "*.safetensors", "*.model", "*.tiktoken", "*.txt", "*.jinja"]


def is_repo_id(spec: str) -> bool:
    """Whether `spec` is spelled like a Hub repo id (`name` or `org/name`)."""
    try:
        validate_repo_id(spec)
    except HFValidationError:
        return False
    return True


def _complete(snapshot: Path) -> bool:
    return (snapshot / "config.json").is_file() and any(snapshot.glob("*.safetensors"))


def resolve_model_dir(spec: str | None, flag: str) -> str | None:
    """`spec` itself when it is unset, `default`, an existing path or not spelled like a repo id (the loader
    reports a missing path); else the snapshot directory of repo id `spec`: the cached one when complete, else a
    download."""
    if spec in (None, "", "default") or Path(spec).expanduser().exists() or not is_repo_id(spec):
        return spec
    try:
        cached = Path(snapshot_download(spec, local_files_only=True))
    except LocalEntryNotFoundError:
        cached = None
    if cached is not None and (_complete(cached) or constants.HF_HUB_OFFLINE):
        return str(cached)
    where = f"the local Hugging Face cache ({constants.HF_HUB_CACHE})"
    if constants.HF_HUB_OFFLINE:
        raise UserError(
            f"{flag}: {spec!r} is neither a local path nor in {where}, and HF_HUB_OFFLINE is set, so it was not "
            "downloaded; unset HF_HUB_OFFLINE to download it, or give a model directory",
            param=flag,
        )
    try:
        return snapshot_download(spec, allow_patterns=MODEL_FILES)
    except GatedRepoError:
        reason = "the repository is gated: accept its terms on huggingface.co and log in (`hf auth login` or HF_TOKEN)"
    except RepositoryNotFoundError:
        reason = "the Hub has no such repository (or it is private: log in with `hf auth login` or set HF_TOKEN)"
    except RevisionNotFoundError:
        reason = "the Hub repository has no main revision"
    except (LocalEntryNotFoundError, OSError) as e:  # no connection, and nothing cached
        reason = f"downloading it failed ({str(e).splitlines()[0]})"
    raise UserError(f"{flag}: {spec!r} is neither a local path nor in {where}; {reason}", param=flag)
