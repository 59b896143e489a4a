"""The drafter's fused q|k|v and gate|up under `--draft-weight-quantization` fp8 and nvfp4.

Reference: the checkpoint's separate tensors quantized one by one (`quantize_fp8_row`, `quantize_nvfp4`), their
rows laid out by hand in numpy (per KV head its query heads, its key head, its value head; gate row i beside up
row i), and the numpy float64 drafter of `test_drafter_reference` run on the dequantized separate weights.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dflash_jax.checkpoints.export import apply_weight_tier
from dflash_jax.models.drafter import DrafterModel, contiguous_drafter_cache
from dflash_jax.models.layers import DictBuilder, Pages, fused_gated_mlp, kv_heads, qkv_heads
from dflash_jax.quant import Fp8RowWeight, Nvfp4Weight, quantize_fp8_row, quantize_nvfp4
from dflash_jax.quant.formats import dequantize, nvfp4_global_scale
from dflash_jax.quant.linear import linear
from tests.models.test_drafter_reference import (
    BASE,
    TOL,
    VARIANTS,
    H,
    V,
    jit_propose,
    jit_write_context,
    random_weights,
    reference_block,
)

CFG = VARIANTS["mixed"]  # 6 query heads over 3 KV heads: query groups of 2
QKV = ("q_proj", "k_proj", "v_proj")
GATE_UP = ("gate_proj", "up_proj")


def _weights(cfg=CFG, seed: int = 21) -> dict[str, np.ndarray]:
    """z-lab names, [in, out]; k_proj scaled up so that the parts' NVFP4 global scales differ."""
    w = random_weights(cfg, seed)
    for i in range(cfg.num_layers):
        w[f"layers.{i}.self_attn.k_proj.weight"] *= 3.0
        w[f"layers.{i}.mlp.up_proj.weight"] *= 2.0
    return w


def _part(name: str, i: int) -> str:
    sub = "self_attn" if name in QKV or name == "o_proj" else "mlp"
    return f"layers.{i}.{sub}.{name}.weight"


def qkv_rows_by_hand(q, k, v, num_kv_heads: int) -> np.ndarray:
    """Rows [out, ...] of q, k and v laid out per KV head: its query heads' rows, its key rows, its value rows."""
    qh, kh, vh = (np.split(np.asarray(a), num_kv_heads) for a in (q, k, v))
    return np.concatenate([np.concatenate([qh[j], kh[j], vh[j]]) for j in range(num_kv_heads)])


def gate_up_rows_by_hand(gate, up) -> np.ndarray:
    """Rows of gate and up interleaved: gate row 0, up row 0, gate row 1, ..."""
    gate, up = np.asarray(gate), np.asarray(up)
    out = np.empty((2 * gate.shape[0], *gate.shape[1:]), gate.dtype)
    out[0::2], out[1::2] = gate, up
    return out


def _codes(a) -> np.ndarray:
    a = np.asarray(a)
    return a.view(np.uint8) if a.dtype.itemsize == 1 else a


class Inputs:
    def __init__(self, cfg=CFG):
        rng = np.random.default_rng(22)
        self.embed = rng.standard_normal((V, H)).astype(np.float32)
        self.lm_head = (0.3 * rng.standard_normal((H, V))).astype(np.float32)
        self.taps = rng.standard_normal((2, 14, cfg.num_taps * H)).astype(np.float32)
        self.starts, self.anchors = np.array([11, 6]), np.array([7, 42])


def drafter_logits(model: DrafterModel, head, x: Inputs, width: int = 5) -> np.ndarray:
    """Draft logits [2, width-1, V] for two sequences (slots 2 and 0 of three) after their context is written."""
    cache, pages = contiguous_drafter_cache(model.cfg, 3, 32, page_size=8)
    slots = Pages(pages.table[jnp.asarray([2, 0])])
    gd, state = nnx.split(model)
    pos = jnp.broadcast_to(jnp.arange(14, dtype=jnp.int32), (2, 14))
    cache = jit_write_context(gd, state, cache, jnp.asarray(x.taps), pos, slots)
    anchors, starts = jnp.asarray(x.anchors, jnp.int32), jnp.asarray(x.starts, jnp.int32)
    _, logits = jit_propose(
        gd, state, jnp.asarray(x.embed), head, cache, anchors, starts, slots, width=width, kv_len=16
    )
    return np.asarray(logits)


def reference_logits(cfg, w: dict, x: Inputs, lm_head, width: int = 5) -> np.ndarray:
    out = []
    for b in range(2):
        st = x.starts[b]
        _, ref = reference_block(cfg, w, x.taps[b, :st], np.arange(st), x.anchors[b], st, width, x.embed, lm_head)
        out.append(ref[1:])
    return np.stack(out)


def _deq_in_out(q) -> np.ndarray:
    """A quantized [out, in] weight dequantized to our [in, out] layout."""
    return np.asarray(dequantize(q)).T


# ---------------------------------------------------------------------------------------------------- fp8
def test_fp8_fused_rows_are_the_separate_tensors_rows_with_their_scales():
    w = _weights()
    model = DrafterModel(CFG, H, DictBuilder(dict(w), "test"))
    apply_weight_tier(model, jnp.asarray(Inputs().lm_head), "fp8")
    for i in range(CFG.num_layers):
        sep = {n: quantize_fp8_row(jnp.asarray(w[_part(n, i)].T)) for n in QKV + GATE_UP}
        qkv, gate_up = model.layers[i].qkv_proj[...], model.layers[i].gate_up_proj[...]
        assert isinstance(qkv, Fp8RowWeight) and isinstance(gate_up, Fp8RowWeight)
        for field in ("q", "scale"):
            want = qkv_rows_by_hand(*(_codes(getattr(sep[n], field)) for n in QKV), CFG.num_kv_heads)
            np.testing.assert_array_equal(_codes(getattr(qkv, field)), want, err_msg=f"layer {i} qkv {field}")
            want = gate_up_rows_by_hand(*(_codes(getattr(sep[n], field)) for n in GATE_UP))
            np.testing.assert_array_equal(_codes(getattr(gate_up, field)), want, err_msg=f"layer {i} gate|up {field}")


def test_fp8_fused_matmuls_equal_the_separate_quantized_matmuls():
    w = _weights()
    model = DrafterModel(CFG, H, DictBuilder(dict(w), "test"))
    apply_weight_tier(model, jnp.asarray(Inputs().lm_head), "fp8")
    layer = model.layers[0]
    sep = {n: quantize_fp8_row(jnp.asarray(w[_part(n, 0)].T)) for n in (*QKV, *GATE_UP, "down_proj")}
    x = jnp.asarray(np.random.default_rng(3).standard_normal((2, 5, H)), jnp.float32)
    g = CFG.num_heads // CFG.num_kv_heads
    q, k, v = (np.asarray(a) for a in qkv_heads(x, layer.qkv_proj[...], g, CFG.head_dim))
    d = CFG.head_dim
    np.testing.assert_allclose(q, np.asarray(linear(x, sep["q_proj"])).reshape(2, 5, -1, d), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(k, np.asarray(linear(x, sep["k_proj"])).reshape(2, 5, -1, d), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(v, np.asarray(linear(x, sep["v_proj"])).reshape(2, 5, -1, d), rtol=1e-6, atol=1e-6)
    got = np.asarray(fused_gated_mlp(x, layer.gate_up_proj[...], layer.down_proj[...]))
    gate, up = np.asarray(linear(x, sep["gate_proj"])), np.asarray(linear(x, sep["up_proj"]))
    want = np.asarray(linear(jnp.asarray(gate / (1 + np.exp(-gate)) * up), sep["down_proj"]))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("tier", ["fp8", "nvfp4"])
def test_context_kv_of_the_fused_quantized_weight_equals_its_key_and_value_rows(tier):
    """The context path's k and v (`kv_heads`: only the key and value rows of each KV head's block) against the
    fused weight's full q|k|v matmul and against the key and value rows taken out one by one in numpy."""
    w = _weights()
    model = DrafterModel(CFG, H, DictBuilder(dict(w), "test"))
    apply_weight_tier(model, jnp.asarray(Inputs().lm_head), tier)
    fused = model.layers[0].qkv_proj[...]
    g, d = CFG.num_heads // CFG.num_kv_heads, CFG.head_dim
    x = jnp.asarray(np.random.default_rng(5).standard_normal((2, 3, H)), jnp.float32)
    k, v = (np.asarray(a) for a in jax.jit(kv_heads, static_argnums=(2, 3))(x, fused, g, d))
    _, k_all, v_all = (np.asarray(a) for a in qkv_heads(x, fused, g, d))
    np.testing.assert_allclose(k, k_all, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(v, v_all, rtol=1e-6, atol=1e-6)
    dense = np.asarray(dequantize(fused, jnp.float32)).reshape(CFG.num_kv_heads, g + 2, d, H)
    xs = np.asarray(x, np.float64)
    np.testing.assert_allclose(k, np.einsum("bti,kdi->btkd", xs, dense[:, g]), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(v, np.einsum("bti,kdi->btkd", xs, dense[:, g + 1]), rtol=1e-4, atol=1e-4)


def _tier_reference_weights(w: dict, tier: str) -> dict:
    """The drafter's weights as the tier should compute with them, from the separate tensors: FP8 per tensor;
    NVFP4 with one global scale per fused group (the largest of the group's parts), `fc` included."""
    out = dict(w)
    for i in range(CFG.num_layers):
        for group in (QKV, GATE_UP, ("o_proj",), ("down_proj",)):
            parts = {n: jnp.asarray(w[_part(n, i)].T) for n in group}
            if tier == "fp8":
                quant = {n: quantize_fp8_row(p) for n, p in parts.items()}
            else:
                shared = max(float(nvfp4_global_scale(p)) for p in parts.values())
                quant = {n: quantize_nvfp4(p, global_scale=shared) for n, p in parts.items()}
            out |= {_part(n, i): _deq_in_out(qw) for n, qw in quant.items()}
    if tier == "nvfp4":
        out["fc.weight"] = _deq_in_out(quantize_nvfp4(jnp.asarray(w["fc.weight"].T)))
    return out


@pytest.mark.parametrize("tier", ["fp8", "nvfp4"])
def test_quantized_fused_drafter_logits_equal_the_reference_on_separately_quantized_weights(tier):
    w, x = _weights(), Inputs()
    model = DrafterModel(CFG, H, DictBuilder(dict(w), "test"))
    head = apply_weight_tier(model, jnp.asarray(x.lm_head), tier)
    got = drafter_logits(model, head, x)
    quantize = quantize_fp8_row if tier == "fp8" else quantize_nvfp4
    ref_head = _deq_in_out(quantize(jnp.asarray(x.lm_head.T)))
    want = reference_logits(CFG, _tier_reference_weights(w, tier), x, ref_head)
    np.testing.assert_allclose(got, want, atol=TOL, rtol=TOL)
    # the quantization is visible: the unquantized reference differs by far more than the tolerance
    assert np.abs(reference_logits(CFG, w, x, x.lm_head) - want).max() > 50 * TOL


# ---------------------------------------------------------------------------------------------------- nvfp4
def test_nvfp4_fused_groups_share_one_global_scale():
    w = _weights()
    model = DrafterModel(CFG, H, DictBuilder(dict(w), "test"))
    apply_weight_tier(model, jnp.asarray(Inputs().lm_head), "nvfp4")
    for i in range(CFG.num_layers):
        for fused, group in (("qkv_proj", QKV), ("gate_up_proj", GATE_UP)):
            wq = getattr(model.layers[i], fused)[...]
            assert isinstance(wq, Nvfp4Weight)
            amax = max(np.abs(w[_part(n, i)]).max() for n in group)
            own = [np.abs(w[_part(n, i)]).max() / (448 * 6) for n in group]
            assert len({round(float(s), 9) for s in own}) == len(group)  # the parts alone would differ
            np.testing.assert_allclose(float(wq.global_scale), amax / (448 * 6), rtol=1e-6)
            shared = float(wq.global_scale)
            sep = [quantize_nvfp4(jnp.asarray(w[_part(n, i)].T), global_scale=shared) for n in group]
            for field in ("packed", "block_scale"):
                parts = [_codes(getattr(s, field)) for s in sep]
                want = (
                    qkv_rows_by_hand(*parts, CFG.num_kv_heads) if fused == "qkv_proj" else gate_up_rows_by_hand(*parts)
                )
                np.testing.assert_array_equal(_codes(getattr(wq, field)), want, err_msg=f"layer {i} {fused} {field}")


def test_base_config_fuses_too():
    """BASE (2 query heads per KV head, other sizes) builds and keeps the unfused reference's logits (dense)."""
    w, x = random_weights(BASE, 5), Inputs(BASE)
    model = DrafterModel(BASE, H, DictBuilder(dict(w), "test"))
    assert model.layers[0].qkv_proj[...].shape == (H, BASE.num_kv_heads, BASE.num_heads // BASE.num_kv_heads + 2, 8)
    np.testing.assert_allclose(
        drafter_logits(model, jnp.asarray(x.lm_head), x), reference_logits(BASE, w, x, x.lm_head), atol=TOL, rtol=TOL
    )
