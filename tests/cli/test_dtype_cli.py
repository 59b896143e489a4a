"""`--dtype`: its values and refusal, the commands that take it load the model in that dtype, and the start-up
memory estimate counts the models' real weight and cache dtypes."""

from __future__ import annotations

import jax.numpy as jnp
import pytest
from typer.testing import CliRunner

from dflash_jax.builder import Models, load_models, memory_preflight, resolve_dtype
from dflash_jax.checkpoints.loader import LoadedTarget
from dflash_jax.cli.main import app
from dflash_jax.errors import UserError
from dflash_jax.kv.sizing import layer_kv_bytes_per_token
from dflash_jax.models.drafter import DrafterModel
from dflash_jax.models.layers import RandomBuilder
from dflash_jax.models.target import TargetModel, param_count
from tests.checkpoints.test_loading_errors import cli_error, write_model
from tests.conftest import TINY_LLAMA, tiny_drafter_config


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return str(write_model(tmp_path_factory.mktemp("tiny") / "target"))


def test_resolve_dtype_values_and_refusal():
    assert resolve_dtype("bfloat16") == jnp.bfloat16
    assert resolve_dtype("float16") == jnp.float16
    assert resolve_dtype("float32") == jnp.float32
    assert resolve_dtype("auto") == jnp.float32  # the tests run on the CPU backend
    with pytest.raises(UserError, match="--dtype must be auto, bfloat16, float16, float32, got 'fp8'") as e:
        resolve_dtype("fp8")
    assert e.value.param == "--dtype"


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_load_models_loads_target_and_drafter_in_the_dtype(tiny_model, dtype):
    m = load_models(tiny_model, "random:1", resolve_dtype(dtype))
    assert m.target.model.dtype == jnp.dtype(dtype) and m.drafter.dtype == jnp.dtype(dtype)
    assert m.target.model.layers[0].qkv_proj[...].dtype == jnp.dtype(dtype)
    assert m.drafter.fc[...].dtype == jnp.dtype(dtype)


def test_generate_runs_in_bf16_and_refuses_a_bad_dtype(tiny_model):
    res = CliRunner().invoke(
        app, ["generate", "--model", tiny_model, "--prompt", "w3 w4", "--max-tokens", "4", "--dtype", "bfloat16"]
    )
    assert res.exit_code == 0, f"{res.output}\n{res.exception!r}"
    assert len(res.stdout.split()) == 4
    line = cli_error(["generate", "--model", tiny_model, "--prompt", "w3", "--dtype", "int8"])
    assert "--dtype" in line and "int8" in line
    info = CliRunner().invoke(app, ["info", "--model", tiny_model, "--dtype", "float16"])
    assert info.exit_code == 0 and "dtype        float16" in info.stdout


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=["bf16", "f32"])
def test_memory_preflight_counts_the_real_dtypes(dtype):
    """Target weights and KV at the weights' itemsize; the drafter's KV at its own dtype's; the drafter's copy of
    the LM head in the target's dtype."""
    cfg = TINY_LLAMA
    target = TargetModel(cfg, RandomBuilder(0, dtype=dtype))
    drafter = DrafterModel(tiny_drafter_config(cfg), cfg.hidden_size, RandomBuilder(1, dtype=dtype))
    models = Models(LoadedTarget(cfg, target, None, "mem", "mem"), drafter, target.lm_head[...])
    lines = []
    b = memory_preflight(models, max_slots=3, max_model_len=40, gamma=4, tier="declared", log=lines.append)
    size = jnp.dtype(dtype).itemsize
    dc = drafter.cfg
    assert b["target_weights"] == param_count(cfg) * size
    assert b["target_kv_cache"] == layer_kv_bytes_per_token(cfg, dtype) * 4 * 45
    assert b["target_kv_cache"] == 2 * cfg.num_layers * 4 * 45 * cfg.num_kv_heads * cfg.head_dim * size
    assert b["drafter_kv_cache"] == 2 * dc.num_layers * 4 * 45 * dc.num_kv_heads * dc.head_dim * size
    n_drafter = sum(x.size for x in jax_leaves(drafter))
    assert b["drafter_weights"] == (n_drafter + cfg.vocab_size * cfg.hidden_size) * size
    assert jnp.dtype(dtype).name in lines[0]


def jax_leaves(model):
    import jax
    from flax import nnx

    return jax.tree.leaves(nnx.state(model, nnx.Param))
