"""Drafter config.json cases, each on a file written the way z-lab's tooling writes it: a transformers `Qwen3Config`
carrying the DFlash fields, saved with `save_pretrained`. Each is checked against the reference (transformers' own
reading of the same file for layer types, window and head_dim; z-lab's formula for the default taps) or refused
with an error naming the field.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from flax import nnx

from dflash_jax.checkpoints.drafter import drafter_config_from_hf, load_drafter
from dflash_jax.checkpoints.export import export_drafter
from dflash_jax.config import RopeScaling, default_target_layer_ids
from dflash_jax.errors import CheckpointError

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")


def zlab_config(path: Path, **kw) -> dict:
    """config.json of a DFlash drafter as z-lab's tooling saves it (a Qwen3Config plus the DFlash fields)."""
    fields = dict(
        architectures=["DFlashDraftModel"],
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=100,
        block_size=16,
        num_target_layers=8,
        dflash_config={"mask_token_id": 99, "target_layer_ids": [1, 3]},
    )
    fields.update(kw)
    path.mkdir(parents=True, exist_ok=True)
    transformers.Qwen3Config(**fields).save_pretrained(path)
    return json.loads((path / "config.json").read_text())


def transformers_view(d: dict) -> transformers.Qwen3Config:
    """The reference's reading of a config.json (z-lab's model classes take a Qwen3Config)."""
    return transformers.Qwen3Config.from_dict(d)


# ------------------------------------------------------------------------------------------ default taps
@pytest.mark.parametrize(
    "target_layers, draft_layers, expected",
    [
        # 1 + i * 58 / 4 = 1, 15.5, 30, 44.5, 59: halves go to the even neighbour (16, 44), not up (16, 45)
        (62, 5, (1, 16, 30, 44, 59)),
        # 1 + i * 7 / 2 = 1, 4.5, 8
        (11, 3, (1, 4, 8)),
        # 1 + i * 5 / 2 = 1, 3.5, 6
        (9, 3, (1, 4, 6)),
        # 1 + i * 32 / 4: no halves
        (36, 5, (1, 9, 17, 25, 33)),
        # one draft layer: the middle layer
        (32, 1, (16,)),
        (27, 1, (13,)),
    ],
)
def test_default_target_layer_ids_round_like_the_reference(target_layers, draft_layers, expected):
    assert default_target_layer_ids(target_layers, draft_layers) == expected


def test_config_without_target_layer_ids_gets_the_reference_default(tmp_path):
    d = zlab_config(tmp_path, num_hidden_layers=5, num_target_layers=62, dflash_config={"mask_token_id": 99})
    assert "target_layer_ids" not in d["dflash_config"]
    assert drafter_config_from_hf(d, "d").target_layer_ids == (1, 16, 30, 44, 59)


# ------------------------------------------------------------------------------------------ layer attention
@pytest.mark.parametrize(
    "kw, expected",
    [
        ({}, ((0, False), (0, False))),  # Qwen3Config defaults: no sliding window anywhere
        # layer types derived by Qwen3Config from max_window_layers (layer 1 sliding)
        (
            {"use_sliding_window": True, "sliding_window": 7, "max_window_layers": 1, "is_causal": False},
            ((0, False), (7, False)),
        ),
        # mixed types, causal, a window narrower than the block
        (
            {
                "layer_types": ["sliding_attention", "full_attention"],
                "use_sliding_window": True,
                "sliding_window": 3,
                "is_causal": True,
            },
            ((3, True), (0, True)),
        ),
        # sliding types and a window, but use_sliding_window false: transformers drops the window
        (
            {"layer_types": ["sliding_attention"] * 2, "sliding_window": 2048, "is_causal": False},
            ((0, False), (0, False)),
        ),
        # the DFlash 2 fixture's form: all sliding, windowed, non-causal
        (
            {
                "layer_types": ["sliding_attention"] * 2,
                "use_sliding_window": True,
                "sliding_window": 2048,
                "is_causal": False,
            },
            ((2048, False), (2048, False)),
        ),
    ],
    ids=["defaults", "max_window_layers", "mixed-causal", "window-dropped", "all-sliding"],
)
def test_layer_types_and_windows_read_as_transformers_reads_them(tmp_path, kw, expected):
    d = zlab_config(tmp_path, **kw)
    ref = transformers_view(d)
    window = ref.sliding_window or 0
    causal = bool(kw.get("is_causal", False))
    from_ref = tuple((window if t == "sliding_attention" else 0, causal) for t in ref.layer_types)
    assert from_ref == expected
    assert drafter_config_from_hf(d, "d").layer_attn == expected


@pytest.mark.parametrize(
    "kw, expected",
    [
        ({"use_sliding_window": True, "sliding_window": 7, "max_window_layers": 1}, ((0, True), (7, True))),
        ({"use_sliding_window": True, "max_window_layers": 0}, ((4096, True), (4096, True))),  # default window
        ({"use_sliding_window": False, "sliding_window": 7, "max_window_layers": 0}, ((0, True), (0, True))),
    ],
    ids=["max_window_layers-1", "default-window", "no-use_sliding_window"],
)
def test_layer_types_derived_as_transformers_derives_them(tmp_path, kw, expected):
    """A config.json without `layer_types` or `sliding_window` (written by hand or by older tooling):
    Qwen3Config derives the types from use_sliding_window / max_window_layers and defaults the window."""
    d = zlab_config(tmp_path, is_causal=True, **kw)
    del d["layer_types"]
    if "sliding_window" not in kw:
        del d["sliding_window"]
    ref = transformers_view(d)
    from_ref = tuple(((ref.sliding_window or 0) if t == "sliding_attention" else 0, True) for t in ref.layer_types)
    assert from_ref == expected
    assert drafter_config_from_hf(d, "d").layer_attn == expected


def test_sliding_layers_without_is_causal_are_refused(tmp_path):
    d = zlab_config(tmp_path, layer_types=["full_attention", "sliding_attention"], use_sliding_window=True)
    assert "is_causal" not in d
    with pytest.raises(CheckpointError, match=r"sliding_attention.*is_causal"):
        drafter_config_from_hf(d, "d")
    # the attention kernel named (hand-written: save_pretrained does not write it) settles it the z-lab way
    flash = drafter_config_from_hf({**d, "_attn_implementation": "flash_attention_2"}, "d")
    assert flash.layer_attn == ((0, False), (4096, False))  # Qwen3Config's default window
    sdpa = drafter_config_from_hf({**d, "_attn_implementation": "sdpa"}, "d")
    assert sdpa.layer_attn == ((0, False), (0, False))


def test_exported_layer_attention_reads_back(tmp_path, tiny_llama_cfg, drafter_factory):
    """A sliding, causal drafter written by export_drafter loads with the same per-layer attention, and its
    config.json says the same to transformers."""
    model = drafter_factory(tiny_llama_cfg, layer_attn=((3, True), (0, True)))
    path = export_drafter(model, tmp_path / "d", tiny_llama_cfg.num_layers)
    d = json.loads((path / "config.json").read_text())
    ref = transformers_view(d)
    assert ref.layer_types[:2] == ["sliding_attention", "full_attention"] and ref.sliding_window == 3
    assert load_drafter(path, tiny_llama_cfg).cfg.layer_attn == ((3, True), (0, True))


# ------------------------------------------------------------------------------------------ refused / defaulted fields
def test_hidden_act_other_than_silu_is_refused(tmp_path):
    with pytest.raises(CheckpointError, match=r"hidden_act 'gelu'"):
        drafter_config_from_hf(zlab_config(tmp_path, hidden_act="gelu"), "d")
    # swish is SiLU in transformers' activation table (what the reference's MLP calls): accepted
    from transformers.activations import ACT2FN

    x = torch.linspace(-6, 6, 101)
    assert torch.allclose(ACT2FN["swish"](x), torch.nn.functional.silu(x))
    assert drafter_config_from_hf(zlab_config(tmp_path, hidden_act="swish"), "d").hidden_size == 64


def test_attention_bias_is_refused(tmp_path):
    with pytest.raises(CheckpointError, match=r"attention_bias"):
        drafter_config_from_hf(zlab_config(tmp_path, attention_bias=True), "d")


@pytest.mark.parametrize("field", ["use_swa", "swa_window_size"])
def test_vllm_window_fields_are_refused(tmp_path, field):
    """vLLM reads a window from dflash_config.use_swa / swa_window_size; refused rather than ignored."""
    sub = {"mask_token_id": 99, "target_layer_ids": [1, 3], field: True if field == "use_swa" else 64}
    with pytest.raises(CheckpointError, match=rf"dflash_config\.{field}"):
        drafter_config_from_hf(zlab_config(tmp_path, dflash_config=sub), "d")


def test_missing_head_dim_defaults_like_qwen3config(tmp_path, tiny_llama_cfg, drafter_factory):
    """No head_dim: the reference's Qwen3Config takes 128 (not hidden / heads = 16); a checkpoint shaped for 128
    loads, one shaped for hidden / heads is refused naming the mis-shaped tensor."""
    d = zlab_config(tmp_path / "cfg")
    del d["head_dim"]
    assert transformers_view(d).head_dim == 128
    assert drafter_config_from_hf(d, "d").head_dim == 128

    model = drafter_factory(tiny_llama_cfg, head_dim=128)
    path = export_drafter(model, tmp_path / "hd128", tiny_llama_cfg.num_layers)
    cfg = json.loads((path / "config.json").read_text())
    del cfg["head_dim"]
    (path / "config.json").write_text(json.dumps(cfg))
    got = load_drafter(path, tiny_llama_cfg)
    assert got.cfg.head_dim == 128
    ref = dict(nnx.to_flat_state(nnx.state(model, nnx.Param)))
    flat = dict(nnx.to_flat_state(nnx.state(got, nnx.Param)))
    for k in ref:
        np.testing.assert_array_equal(np.asarray(flat[k][...]), np.asarray(ref[k][...]), err_msg=str(k))

    small = export_drafter(drafter_factory(tiny_llama_cfg), tmp_path / "hd8", tiny_llama_cfg.num_layers)
    cfg = json.loads((small / "config.json").read_text())
    del cfg["head_dim"]
    (small / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"layers\.0\.self_attn\.q_proj\.weight"):
        load_drafter(small, tiny_llama_cfg)


def test_null_head_dim_is_refused(tmp_path):
    d = zlab_config(tmp_path)
    d["head_dim"] = None
    with pytest.raises(CheckpointError, match=r"head_dim"):
        drafter_config_from_hf(d, "d")


# ------------------------------------------------------------------------------------------ RoPE scaling round trip
def _drafts(model, tcfg, seed: int = 0):
    """Drafts and draft logits of `model` for two sequences over random target taps (contexts of 20 and 13 rows)."""
    import jax.numpy as jnp

    from dflash_jax.models.drafter import contiguous_drafter_cache, propose_block, write_context

    rng = np.random.default_rng(seed)
    n_taps = len(model.cfg.target_layer_ids)
    taps = jnp.asarray(rng.normal(size=(2, 20, n_taps * tcfg.hidden_size)), jnp.float32)
    embed = jnp.asarray(rng.normal(size=(tcfg.vocab_size, tcfg.hidden_size)) * 0.2, jnp.float32)
    lm_head = jnp.asarray(rng.normal(size=(tcfg.hidden_size, tcfg.vocab_size)) * 0.2, jnp.float32)
    pos = jnp.asarray(np.broadcast_to(np.arange(20), (2, 20)), jnp.int32)
    cache, pages = contiguous_drafter_cache(model.cfg, 2, 32)
    cache = write_context(model, cache, taps, pos, pages)
    anchor, start = jnp.asarray([5, 9], jnp.int32), jnp.asarray([20, 13], jnp.int32)
    drafts, logits = propose_block(model, embed, lm_head, cache, anchor, start, pages, width=4, kv_len=32)
    return np.asarray(drafts), np.asarray(logits)


@pytest.mark.parametrize(
    "scaling",
    [
        RopeScaling("linear", factor=4.0),
        RopeScaling(
            "llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8
        ),
        RopeScaling("freq_factors", freq_factors=(1.0, 1.5, 6.0, 8.0)),
        RopeScaling("yarn", factor=4.0, original_max_position_embeddings=64, beta_fast=16.0, attention_factor=1.2),
    ],
    ids=lambda s: s.rope_type,
)
def test_exported_rope_scaling_reads_back_with_the_same_drafts(tmp_path, scaling, tiny_llama_cfg, drafter_factory):
    """A drafter with RoPE scaling, exported and loaded back: the same config and the same drafts; transformers
    reads the same scaling from the file (except dflash-jax's own freq_factors type, which it has no form for)."""
    model = drafter_factory(tiny_llama_cfg, rope_scaling=scaling)
    path = export_drafter(model, tmp_path / "d", tiny_llama_cfg.num_layers)
    d = json.loads((path / "config.json").read_text())
    back = load_drafter(path, tiny_llama_cfg)
    assert back.cfg == model.cfg and back.cfg.rope_scaling == scaling
    if scaling.rope_type != "freq_factors":
        ref = transformers_view(d).rope_parameters
        assert ref["rope_type"] == scaling.rope_type and ref["factor"] == scaling.factor
        if scaling.rope_type == "yarn":
            assert (ref["attention_factor"], ref["beta_fast"], ref["original_max_position_embeddings"]) == (1.2, 16, 64)
        if scaling.rope_type == "llama3":
            assert (ref["low_freq_factor"], ref["high_freq_factor"], ref["original_max_position_embeddings"]) == (
                1.0,
                4.0,
                8,
            )
    drafts, logits = _drafts(model, tiny_llama_cfg)
    drafts_back, logits_back = _drafts(back, tiny_llama_cfg)
    np.testing.assert_array_equal(drafts_back, drafts)
    np.testing.assert_allclose(logits_back, logits, rtol=1e-5, atol=1e-5)
    # the scaling matters: the same weights without it draft other logits
    _, unscaled = _drafts(drafter_factory(tiny_llama_cfg), tiny_llama_cfg)
    assert np.abs(unscaled - logits).max() > 1e-3


def test_missing_kv_heads_default_like_qwen3config(tmp_path):
    """No num_key_value_heads: the reference's Qwen3Config takes 32 (not num_attention_heads); where 32 does not
    divide the head count the config is refused naming the field."""
    d = zlab_config(tmp_path / "cfg", num_attention_heads=64, hidden_size=128, head_dim=16)
    del d["num_key_value_heads"]
    assert transformers_view(d).num_key_value_heads == 32
    assert drafter_config_from_hf(d, "d").num_kv_heads == 32
    small = zlab_config(tmp_path / "small")
    del small["num_key_value_heads"]
    with pytest.raises(CheckpointError, match="num_key_value_heads"):
        drafter_config_from_hf(small, "d")


def test_block_size_read_as_zlab_reads_it(tmp_path):
    """The top-level block_size is z-lab's; dflash_config.block_size alone is used; two that disagree are refused
    naming both fields."""
    d = zlab_config(tmp_path / "cfg", block_size=8)
    assert drafter_config_from_hf(d, "d").block_size == 8
    only_inner = dict(d, dflash_config={**d["dflash_config"], "block_size": 12})
    del only_inner["block_size"]
    assert drafter_config_from_hf(only_inner, "d").block_size == 12
    both = dict(d, dflash_config={**d["dflash_config"], "block_size": 12})
    with pytest.raises(CheckpointError, match=r"block_size=8 and dflash_config\.block_size=12"):
        drafter_config_from_hf(both, "d")
