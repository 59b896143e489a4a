"""`--model` / `--draft-model` as Hugging Face repo ids, resolved with huggingface_hub.

The cache is built in tmp_path the way huggingface_hub lays it out (`models--org--name/blobs/<hash>`,
`snapshots/<rev>/<file>` symlinks into the blobs, `refs/main` naming the revision), with `HF_HUB_CACHE` pointing
there and `HF_HUB_OFFLINE=1`, so nothing touches the network: a target and a drafter load from it by repo id, a
local path wins over a repo id of the same spelling, and an id in neither place is one clear error naming it.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import httpx
import numpy as np
import pytest
from flax import nnx
from huggingface_hub import constants
from typer.testing import CliRunner

from dflash_jax.builder import load_models
from dflash_jax.checkpoints import hub
from dflash_jax.checkpoints.export import export_drafter
from dflash_jax.checkpoints.loader import load_target
from dflash_jax.cli.main import app
from dflash_jax.errors import UserError
from tests.tinymodels import write_tiny_llama

REV = "0f3c2a9d41b7e8c6a5d4f3b2a1908e7d6c5b4a39"


@pytest.fixture
def hub_cache(tmp_path, monkeypatch) -> Path:
    """An empty Hugging Face cache under tmp_path, offline (huggingface_hub reads its settings at import, so the
    module's constants are set too)."""
    cache = tmp_path / "hf-cache"
    cache.mkdir()
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return cache


def put_in_cache(cache: Path, repo_id: str, src: Path, rev: str = REV) -> Path:
    """Lay `src`'s files out as huggingface_hub caches a download of `repo_id` at `rev` (the `main` ref)."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    (repo / "blobs").mkdir(parents=True)
    snap = repo / "snapshots" / rev
    snap.mkdir(parents=True)
    for f in sorted(src.iterdir()):
        data = f.read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        (snap / f.name).symlink_to(os.path.relpath(blob, snap))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(rev)
    return snap


def params(model) -> dict:
    return {k: np.asarray(v[...]) for k, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}


def assert_same_params(a, b):
    pa, pb = params(a), params(b)
    assert pa.keys() == pb.keys()
    for k in pa:
        np.testing.assert_array_equal(pa[k], pb[k], err_msg=str(k))


@pytest.fixture
def tiny_target_dir(tmp_path) -> Path:
    return write_tiny_llama(tmp_path / "src-target", hidden=32, layers=3, heads=4, kv_heads=2, inter=48)


def test_target_and_drafter_load_by_repo_id_from_the_cache(hub_cache, tiny_target_dir, tmp_path, drafter_factory):
    snap = put_in_cache(hub_cache, "org/tiny-llama", tiny_target_dir)
    direct = load_target(str(tiny_target_dir))
    drafter = drafter_factory(direct.cfg)
    draft_src = export_drafter(drafter, tmp_path / "src-drafter", direct.cfg.num_layers)
    put_in_cache(hub_cache, "z-lab/tiny-llama-DFlash", draft_src)

    m = load_models("org/tiny-llama", "z-lab/tiny-llama-DFlash")
    assert m.target.source == str(snap)
    assert m.target.model_id == "org/tiny-llama"  # named as the user typed it, not by the snapshot hash
    assert_same_params(m.target.model, direct.model)
    assert m.drafter.cfg == drafter.cfg
    assert_same_params(m.drafter, drafter)


def test_local_path_wins_over_a_repo_id(hub_cache, tiny_target_dir, tmp_path, monkeypatch):
    """A directory `org/tiny-llama` under the working directory is loaded instead of the cached repo."""
    put_in_cache(hub_cache, "org/tiny-llama", tiny_target_dir)
    monkeypatch.chdir(tmp_path)
    write_tiny_llama(tmp_path / "org" / "tiny-llama", hidden=32, layers=3, heads=4, kv_heads=2, inter=48, seed=7)
    m = load_models("org/tiny-llama", None)
    assert m.target.source == "org/tiny-llama" and m.drafter is None
    local = load_target(str(tmp_path / "org" / "tiny-llama"))
    assert_same_params(m.target.model, local.model)
    other = load_target(str(tiny_target_dir))
    assert not np.array_equal(params(m.target.model)[("embed",)], params(other.model)[("embed",)])


def test_unknown_repo_id_is_one_clear_error(hub_cache):
    with pytest.raises(UserError, match=r"--draft-model: 'org/missing' .*local Hugging Face cache.*HF_HUB_OFFLINE"):
        hub.resolve_model_dir("org/missing", "--draft-model")
    # through the CLI: one `error:` line naming the id, no traceback
    res = CliRunner().invoke(app, ["info", "--model", "org/missing"])
    assert isinstance(res.exception, SystemExit) and res.exit_code != 0
    assert "Traceback" not in res.output
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and "'org/missing'" in lines[0], res.stderr


def test_online_the_cache_comes_first_then_a_download(hub_cache, tiny_target_dir, monkeypatch):
    """Online, a complete cached snapshot is used as is; a repo missing from the cache is downloaded (only the
    files a model directory needs); a failed download is an error naming the id."""
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    snap = put_in_cache(hub_cache, "org/cached", tiny_target_dir)
    calls = []
    real = hub.snapshot_download

    def fake(repo_id, **kw):
        calls.append((repo_id, kw))
        if kw.get("local_files_only"):
            return real(repo_id, **kw)
        if repo_id == "org/fresh":  # what a download leaves behind
            return str(put_in_cache(hub_cache, repo_id, tiny_target_dir, rev="1" * 40))
        url = f"https://huggingface.co/api/models/{repo_id}"
        response = httpx.Response(404, request=httpx.Request("GET", url))
        raise hub.RepositoryNotFoundError("404 Client Error: Repository Not Found", response=response)

    monkeypatch.setattr(hub, "snapshot_download", fake)
    assert hub.resolve_model_dir("org/cached", "--model") == str(snap)
    assert calls == [("org/cached", {"local_files_only": True})]
    calls.clear()
    fresh = hub.resolve_model_dir("org/fresh", "--model")
    assert Path(fresh).parent.parent.name == "models--org--fresh"
    assert [kw.get("local_files_only", False) for _, kw in calls] == [True, False]
    assert calls[1][1]["allow_patterns"] == hub.MODEL_FILES
    with pytest.raises(UserError, match=r"--model: 'org/nope' .*no such repository"):
        hub.resolve_model_dir("org/nope", "--model")


def test_paths_that_are_not_repo_ids_are_left_to_the_loader(hub_cache, tmp_path):
    missing = str(tmp_path / "no-such-model")
    assert hub.resolve_model_dir(missing, "--model") == missing
    with pytest.raises(UserError, match=r"--model: path .*no-such-model.* does not exist"):
        load_models(missing, None)
