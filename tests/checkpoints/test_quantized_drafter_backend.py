"""A quantized drafter checkpoint (as `dflash-jax quantize` writes it) loads with its weights on the requested
kernel backend: every quantized tensor and the LM-head copy carry it, the propose then calls the Pallas kernels
(interpret mode on CPU), and its drafts equal those of the in-memory drafter on the same backend."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dflash_jax.checkpoints.drafter import load_drafter_and_head
from dflash_jax.checkpoints.export import apply_weight_tier, drafter_config_json, drafter_weights_as_stored
from dflash_jax.models.drafter import DrafterModel, contiguous_drafter_cache, propose_block, write_context
from dflash_jax.models.layers import RandomBuilder
from dflash_jax.quant import is_quantized, save_quantized
from tests.conftest import tiny_drafter_config
from tests.quant.jaxpr_count import pallas_calls


def _backends(model) -> set[str]:
    leaves = jax.tree.leaves(nnx.state(model, nnx.Param), is_leaf=is_quantized)
    return {w.backend for w in leaves if is_quantized(w)}


def _drafts(model, target, head):
    rng = np.random.default_rng(0)
    hidden = jnp.asarray(rng.normal(size=(2, 6, 2 * target.cfg.hidden_size)), jnp.float32)
    positions = jnp.broadcast_to(jnp.arange(6, dtype=jnp.int32), (2, 6))
    cache, pages = contiguous_drafter_cache(model.cfg, 2, 16, page_size=8)
    cache = write_context(model, cache, hidden, positions, pages)
    anchor, start = jnp.asarray([5, 9], jnp.int32), jnp.asarray([6, 4], jnp.int32)

    def fn(embed, head, cache):
        return propose_block(model, embed, head, cache, anchor, start, pages, width=4, kv_len=8)[0]

    args = (target.embed[...], head, cache)
    return np.asarray(jax.jit(fn)(*args)), pallas_calls(fn, *args)


@pytest.mark.parametrize("tier", ["fp8", "nvfp4"])
def test_quantized_checkpoint_loads_on_the_requested_kernel_backend(tmp_path, tiny_target, tiny_llama_cfg, tier):
    cfg = tiny_drafter_config(tiny_llama_cfg)
    m = DrafterModel(cfg, tiny_llama_cfg.hidden_size, RandomBuilder(2, std=0.2))
    head = apply_weight_tier(m, tiny_target.lm_head[...], tier, kernel_backend="interpret")
    assert _backends(m) == {"interpret"} and head.backend == "interpret"
    weights = drafter_weights_as_stored(m)
    weights["lm_head.weight"] = head
    save_quantized(tmp_path / "q", weights)
    js = drafter_config_json(m, tiny_llama_cfg.num_layers) | {"dflash_jax_quantization": tier}
    (tmp_path / "q" / "config.json").write_text(json.dumps(js))

    plain, plain_head = load_drafter_and_head(tmp_path / "q", tiny_llama_cfg)  # default: XLA
    assert _backends(plain) == {"xla"} and plain_head.backend == "xla"
    assert _drafts(plain, tiny_target, plain_head)[1] == 0

    loaded, lhead = load_drafter_and_head(tmp_path / "q", tiny_llama_cfg, kernel_backend="interpret")
    assert _backends(loaded) == {"interpret"} and lhead.backend == "interpret"
    got, calls = _drafts(loaded, tiny_target, lhead)
    ref, ref_calls = _drafts(m, tiny_target, head)
    assert calls == ref_calls == 4 * cfg.num_layers + 1  # q|k|v, o, gate|up, down per layer; LM head
    np.testing.assert_array_equal(got, ref)
