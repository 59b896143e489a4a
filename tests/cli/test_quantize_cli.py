"""`dflash-jax quantize` writes a checkpoint that loads directly; every tier keeps greedy output lossless."""

from __future__ import annotations

import numpy as np
import pytest
from typer.testing import CliRunner

from dflash_jax.builder import build_runner, load_models
from dflash_jax.checkpoints.export import export_drafter
from dflash_jax.cli.main import app
from dflash_jax.models.drafter import DrafterModel, random_drafter_config
from dflash_jax.models.layers import RandomBuilder
from dflash_jax.quant import Fp8RowWeight, Nvfp4Weight
from dflash_jax.types import SamplingParams
from tests.tinymodels import write_tiny_llama


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("q")
    target = write_tiny_llama(root / "target", hidden=64, layers=4)
    models = load_models(str(target), None)
    cfg = random_drafter_config(models.target.cfg, num_layers=2, block_size=4)
    drafter = DrafterModel(cfg, 64, RandomBuilder(7, std=0.05))
    export_drafter(drafter, root / "drafter", models.target.cfg.num_layers)
    return target, root / "drafter", root


def _greedy(models, prompt, n=16, gamma=4):
    r = build_runner(models, max_slots=1, max_model_len=64, gamma=gamma if models.drafter is not None else None)
    out = r.add(0, prompt, SamplingParams()).tokens
    while len(out) < n:
        out += r.step([0], {0: n - len(out)})[0].tokens
    return out[:n]


@pytest.mark.parametrize("tier,cls", [("fp8", Fp8RowWeight), ("nvfp4", Nvfp4Weight)])
def test_quantize_writes_a_loadable_checkpoint(dirs, tier, cls):
    target, drafter_dir, root = dirs
    out = root / f"q-{tier}"
    res = CliRunner().invoke(
        app,
        [
            "quantize",
            "--draft-model",
            str(drafter_dir),
            "--out",
            str(out),
            "--draft-weight-quantization",
            tier,
            "--model",
            str(target),
        ],
    )
    assert res.exit_code == 0, res.output
    loaded = load_models(str(target), str(out))  # tier comes from the checkpoint itself
    assert isinstance(loaded.drafter.layers[0].qkv_proj[...], cls)
    assert isinstance(loaded.draft_lm_head, cls)
    fresh = load_models(str(target), str(drafter_dir), quant=tier)
    np.testing.assert_array_equal(
        np.asarray(loaded.drafter.layers[1].down_proj[...].dequantize()),
        np.asarray(fresh.drafter.layers[1].down_proj[...].dequantize()),
    )
    prompt = [5, 9, 17, 33, 60]
    assert _greedy(loaded, prompt) == _greedy(fresh, prompt)


@pytest.mark.parametrize("tier", ["declared", "fp8", "fp8-aux", "nvfp4"])
def test_every_tier_keeps_greedy_output(dirs, tier):
    target, drafter_dir, _ = dirs
    prompt = [3, 14, 15, 92, 65, 35]
    plain = _greedy(load_models(str(target), None), prompt)
    assert _greedy(load_models(str(target), str(drafter_dir), quant=tier), prompt) == plain


def test_bad_tier_is_refused(dirs):
    target, drafter_dir, root = dirs
    res = CliRunner().invoke(
        app,
        [
            "quantize",
            "--draft-model",
            str(drafter_dir),
            "--out",
            str(root / "x"),
            "--draft-weight-quantization",
            "int3",
            "--model",
            str(target),
        ],
    )
    assert res.exit_code == 2
    assert "--draft-weight-quantization" in res.output and "Traceback" not in res.output
