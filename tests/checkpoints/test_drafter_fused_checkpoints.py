"""Drafter checkpoints on disk keep the separate q/k/v and gate/up tensors while the model computes them fused.

* export -> load -> export round trips: the files hold the original tensors (dense: the weights the model was
  built from; quantized: each tensor quantized alone, NVFP4 with its fused group's global scale), and the loaded
  drafter has the same weights and the same logits (dense, fp8, nvfp4);
* an NVFP4 checkpoint whose q/k/v (or gate/up) were quantized with their own global scales (as written before the
  projections were fused) loads requantized to one global scale, with a warning, within the NVFP4 error bound;
* a fused group quantized only in part is refused, naming the tensor.
"""

from __future__ import annotations

import dataclasses
import json
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dflash_jax.checkpoints.drafter import load_drafter, load_drafter_and_head
from dflash_jax.checkpoints.export import (
    apply_weight_tier,
    drafter_config_json,
    drafter_state_dict,
    drafter_weights_as_stored,
    export_drafter,
)
from dflash_jax.config import TargetConfig
from dflash_jax.errors import CheckpointError
from dflash_jax.models.drafter import DrafterModel
from dflash_jax.models.layers import DictBuilder
from dflash_jax.quant import (
    Fp8RowWeight,
    Nvfp4Weight,
    is_quantized,
    load_quantized,
    quantize_drafter_weights,
    quantize_fp8_row,
    quantize_nvfp4,
    save_quantized,
)
from dflash_jax.quant.formats import NVFP4_BLOCK, dequantize
from dflash_jax.quant.io import read_safetensors
from tests.models.test_drafter_fused_projections import (
    CFG,
    GATE_UP,
    QKV,
    Inputs,
    _part,
    _weights,
    drafter_logits,
    gate_up_rows_by_hand,
    qkv_rows_by_hand,
)
from tests.models.test_drafter_reference import H, V

TCFG = TargetConfig(
    arch="qwen3",
    vocab_size=V,
    hidden_size=H,
    intermediate_size=64,
    num_layers=6,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
    rms_norm_eps=1e-6,
    rope_theta=1e6,
    tie_word_embeddings=False,
    max_position_embeddings=256,
    name="fused-ckpt-target",
)
LOGGER = "dflash_jax.checkpoints.drafter"
# CFG's attention shape, with per-layer attention that config.json can express (one window, one causality)
DCFG = dataclasses.replace(CFG, layer_attn=((0, False), (3, False), (0, False), (3, False)))


def _model(w: dict) -> DrafterModel:
    return DrafterModel(DCFG, H, DictBuilder(dict(w), "test"))


def _leaves(model: DrafterModel) -> list[np.ndarray]:
    return [np.asarray(a) for a in jax.tree.leaves(nnx.state(model, nnx.Param))]


def _assert_same_tree(a, b) -> None:
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(la, lb, strict=True):
        assert x.dtype == y.dtype and x.shape == y.shape
        np.testing.assert_array_equal(
            np.atleast_1d(np.asarray(x)).view(np.uint8), np.atleast_1d(np.asarray(y)).view(np.uint8)
        )


def _config(model: DrafterModel, tier: str | None) -> dict:
    js = drafter_config_json(model, TCFG.num_layers)
    return js | {"dflash_jax_quantization": tier} if tier else js


def _save(out, weights: dict, head, model: DrafterModel, tier: str):
    weights = dict(weights)
    weights["lm_head.weight"] = head
    save_quantized(out, weights)
    (out / "config.json").write_text(json.dumps(_config(model, tier)))
    return out


# ---------------------------------------------------------------------------------------------------- dense
def test_dense_export_load_export_round_trip(tmp_path):
    w, x = _weights(), Inputs()
    model = _model(w)
    export_drafter(model, tmp_path / "a", TCFG.num_layers)
    files, _ = read_safetensors(tmp_path / "a" / "model.safetensors")
    assert set(files) == set(w)  # the checkpoint's own tensor names: no fused tensor on disk
    for name, want in w.items():
        np.testing.assert_array_equal(files[name], want.T if want.ndim == 2 else want, err_msg=name)
    loaded = load_drafter(tmp_path / "a", TCFG)
    for got, want in zip(_leaves(loaded), _leaves(model), strict=True):
        np.testing.assert_array_equal(got, want)
    head = jnp.asarray(x.lm_head)
    np.testing.assert_array_equal(drafter_logits(loaded, head, x), drafter_logits(model, head, x))
    export_drafter(loaded, tmp_path / "b", TCFG.num_layers)
    again, _ = read_safetensors(tmp_path / "b" / "model.safetensors")
    assert set(again) == set(files)
    for name in files:
        np.testing.assert_array_equal(again[name], files[name], err_msg=name)


# ---------------------------------------------------------------------------------------------------- quantized
def _separately_quantized(w: dict, tier: str) -> dict:
    """Each fused group's tensors quantized alone ([out, in]); NVFP4 with one global scale over the group."""
    out = {}
    for i in range(DCFG.num_layers):
        for group in (QKV, GATE_UP):
            parts = {n: jnp.asarray(w[_part(n, i)].T) for n in group}
            if tier == "fp8":
                out |= {_part(n, i): quantize_fp8_row(p) for n, p in parts.items()}
            else:
                # the global scale of the group's rows together (as quantizing the stacked rows computes it)
                shared = quantize_nvfp4(jnp.concatenate(list(parts.values()))).global_scale
                out |= {_part(n, i): quantize_nvfp4(p, global_scale=shared) for n, p in parts.items()}
    return out


@pytest.mark.parametrize("tier", ["fp8", "nvfp4"])
def test_quantized_export_load_export_round_trip(tmp_path, caplog, tier):
    w, x = _weights(), Inputs()
    model = _model(w)
    head = apply_weight_tier(model, jnp.asarray(x.lm_head), tier)
    stored = drafter_weights_as_stored(model)
    for name, want in _separately_quantized(w, tier).items():  # on disk: the separate tensors
        _assert_same_tree(stored[name], want)
    _save(tmp_path / "a", stored, head, model, tier)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        loaded, lhead = load_drafter_and_head(tmp_path / "a", TCFG)
    assert not [r for r in caplog.records if r.name == LOGGER]  # shared global scales: stacked exactly
    kind = Fp8RowWeight if tier == "fp8" else Nvfp4Weight
    assert isinstance(loaded.layers[0].qkv_proj[...], kind) and isinstance(loaded.layers[1].gate_up_proj[...], kind)
    _assert_same_tree(nnx.state(loaded, nnx.Param), nnx.state(model, nnx.Param))
    _assert_same_tree(lhead, head)
    np.testing.assert_array_equal(drafter_logits(loaded, lhead, x), drafter_logits(model, head, x))
    _save(tmp_path / "b", drafter_weights_as_stored(loaded), lhead, loaded, tier)
    _assert_same_tree(load_quantized(tmp_path / "b"), load_quantized(tmp_path / "a"))


def test_nvfp4_parts_with_differing_global_scales_are_requantized_with_a_warning(tmp_path, caplog):
    """An NVFP4 checkpoint quantized tensor by tensor (each its own global scale): each fused group is requantized
    with one global scale, one warning per group naming its tensors; the weights stay within NVFP4's error bound
    of the file's (half an E2M1 step times the block's scale: at most one block scale); others load as stored."""
    w, x = _weights(), Inputs()
    model = _model(w)
    weights = {k: jnp.asarray(v) for k, v in drafter_state_dict(model).items()}
    old = quantize_drafter_weights(weights, "nvfp4")  # every tensor alone, its own global scale
    head = quantize_nvfp4(jnp.asarray(x.lm_head.T))
    _save(tmp_path / "old", old, head, model, "nvfp4")
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        loaded, _ = load_drafter_and_head(tmp_path / "old", TCFG)
    warnings = [r.getMessage() for r in caplog.records if r.name == LOGGER and r.levelno == logging.WARNING]
    assert len(warnings) == 2 * DCFG.num_layers
    for i in range(DCFG.num_layers):
        for group in (QKV, GATE_UP):
            names = [_part(n, i) for n in group]
            assert sum(all(n in m for n in names) for m in warnings) == 1, names
            assert all("global scale" in m for m in warnings)
    for i in range(DCFG.num_layers):
        for fused, group in (("qkv_proj", QKV), ("gate_up_proj", GATE_UP)):
            parts = [np.asarray(dequantize(old[_part(n, i)])) for n in group]
            assert len({float(old[_part(n, i)].global_scale) for n in group}) == len(group)
            want = qkv_rows_by_hand(*parts, DCFG.num_kv_heads) if fused == "qkv_proj" else gate_up_rows_by_hand(*parts)
            wq = getattr(loaded.layers[i], fused)[...]
            assert isinstance(wq, Nvfp4Weight)
            np.testing.assert_allclose(float(wq.global_scale), np.abs(want).max() / (448 * 6), rtol=1e-6)
            got = np.asarray(dequantize(wq))
            block = np.repeat(np.asarray(wq.block_scale, np.float32) * float(wq.global_scale), NVFP4_BLOCK, axis=1)
            err = np.abs(got - want)
            assert (err <= block[:, : got.shape[1]] * (1 + 1e-6)).all(), f"layer {i} {fused}"
            assert err.max() > 0  # requantized, not copied
        for n in ("o_proj", "down_proj"):  # not fused: exactly as stored
            _assert_same_tree(getattr(loaded.layers[i], n)[...], old[_part(n, i)])
    # exported again, the groups share their global scale: the file loads exactly, without a warning
    stored = drafter_weights_as_stored(loaded)
    for i in range(DCFG.num_layers):
        for group in (QKV, GATE_UP):
            assert len({float(stored[_part(n, i)].global_scale) for n in group}) == 1
    _save(tmp_path / "new", stored, head, loaded, "nvfp4")
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        again, _ = load_drafter_and_head(tmp_path / "new", TCFG)
    assert not [r for r in caplog.records if r.name == LOGGER]
    _assert_same_tree(nnx.state(again, nnx.Param), nnx.state(loaded, nnx.Param))


@pytest.mark.parametrize(
    ("dense", "mixed", "match"),
    [
        ("layers.1.self_attn.v_proj.weight", None, r"'layers\.1\.self_attn\.v_proj\.weight' is not quantized"),
        ("layers.0.mlp.gate_proj.weight", None, r"'layers\.0\.mlp\.gate_proj\.weight' is not quantized"),
        (None, "layers.0.mlp.up_proj.weight", r"layers\.0\.mlp\.up_proj\.weight.*mix formats"),
    ],
)
def test_partly_quantized_fused_group_is_refused_naming_the_tensor(tmp_path, dense, mixed, match):
    w, x = _weights(), Inputs()
    model = _model(w)
    head = apply_weight_tier(model, jnp.asarray(x.lm_head), "fp8")
    stored = drafter_weights_as_stored(model)
    if dense is not None:  # one part left unquantized ([out, in], as a plain checkpoint holds it)
        stored[dense] = np.asarray(stored[dense].dequantize())
    if mixed is not None:  # one part in another format
        stored[mixed] = quantize_nvfp4(stored[mixed].dequantize())
    assert sum(not is_quantized(v) for k, v in stored.items() if "_proj" in k) == (dense is not None)
    _save(tmp_path / "q", stored, head, model, "fp8")
    with pytest.raises(CheckpointError, match=match):
        load_drafter_and_head(tmp_path / "q", TCFG)
