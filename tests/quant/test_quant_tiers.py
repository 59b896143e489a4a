"""Tier coverage, `parse_tier`, memory estimate and quantized-checkpoint save/load."""

import json
import struct
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import safetensors
import safetensors.numpy

from dflash_jax.errors import CheckpointError, UserError
from dflash_jax.kv.sizing import layer_kv_bytes_per_token
from dflash_jax.quant import (
    TIERS,
    Fp8RowWeight,
    MemoryEstimate,
    Nvfp4Weight,
    check_fits,
    covered_names,
    drafter_weight_bytes,
    estimate_drafter_memory,
    format_bytes,
    load_quantized,
    parse_tier,
    quantize_drafter_weights,
    quantize_fp8_row,
    quantize_nvfp4,
    read_quantized_config,
    save_quantized,
    tier_format,
    weight_bytes_by_tier,
)
from dflash_jax.quant.io import read_safetensors, write_safetensors

H, V, R = 32, 48, 16  # hidden, vocab, selector rank (tiny)
GEMM7 = [f"layers.{i}.self_attn.{p}_proj.weight" for i in range(2) for p in "qkvo"] + [
    f"layers.{i}.mlp.{p}_proj.weight" for i in range(2) for p in ("gate", "up", "down")
]
AUX = [
    "fc.weight",
    "layers.0.attention_conv.kernel_projection.weight",
    "layers.1.mlp_conv.kernel_projection.weight",
    "candidate_selector.hidden_projection.weight",
]
NEVER = [
    "norm.weight",
    "hidden_norm.weight",
    "layers.0.input_layernorm.weight",
    "layers.0.self_attn.q_norm.weight",
    "embed_tokens.weight",
    "candidate_selector.predecessor_codebook",
    "layers.0.attention_conv.bias",
]


def _drafter() -> dict:
    rng = np.random.default_rng(0)
    shapes = {n: (H, H) for n in GEMM7}
    shapes.update(
        {
            "lm_head.weight": (V, H),
            "fc.weight": (H, 3 * H),
            "layers.0.attention_conv.kernel_projection.weight": (H, H),
            "layers.1.mlp_conv.kernel_projection.weight": (H, H),
            "candidate_selector.hidden_projection.weight": (R, H),
            "norm.weight": (H,),
            "hidden_norm.weight": (H,),
            "layers.0.input_layernorm.weight": (H,),
            "layers.0.self_attn.q_norm.weight": (8,),
            "embed_tokens.weight": (V, H),
            "candidate_selector.predecessor_codebook": (V, R),
            "layers.0.attention_conv.bias": (24,),
        }
    )
    return {n: jnp.asarray(rng.standard_normal(s), jnp.float32) for n, s in shapes.items()}


def test_tier_coverage():
    names = GEMM7 + ["lm_head.weight"] + AUX + NEVER
    assert covered_names(names, "declared") == {}
    assert covered_names(names, "fp8") == {n: "fp8" for n in GEMM7 + ["lm_head.weight"]}
    assert covered_names(names, "fp8-aux") == {n: "fp8" for n in GEMM7 + ["lm_head.weight"] + AUX}
    assert covered_names(names, "nvfp4") == {n: "nvfp4" for n in GEMM7 + ["lm_head.weight"] + AUX}
    # "model." prefix (some checkpoints) and near-miss names
    assert tier_format("model.layers.3.self_attn.k_proj.weight", "fp8") == "fp8"
    assert tier_format("model.fc.weight", "fp8-aux") == "fp8"
    assert tier_format("layers.0.self_attn.q_proj.bias", "nvfp4") is None
    assert tier_format("xfc.weight", "nvfp4") is None
    assert tier_format("layers.0.mlp.gate_proj.weight.extra", "fp8") is None


def test_quantize_drafter_weights_per_tier():
    weights = _drafter()
    assert quantize_drafter_weights(weights, "declared") == weights
    for tier in ("fp8", "fp8-aux", "nvfp4"):
        out = quantize_drafter_weights(weights, tier)
        assert out.keys() == weights.keys()
        expected = covered_names(weights, tier)
        kind = Fp8RowWeight if tier != "nvfp4" else Nvfp4Weight
        for name, w in out.items():
            if name in expected:
                assert isinstance(w, kind), (tier, name)
                assert w.shape == weights[name].shape
                dq = np.asarray(w.dequantize())
                ref = np.asarray(weights[name])
                assert np.abs(dq - ref).max() <= (0.07 if tier != "nvfp4" else 0.6) * np.abs(ref).max()
            else:
                assert w is weights[name], (tier, name)
    # already-quantized tensors pass through unchanged
    q = quantize_drafter_weights(weights, "fp8")
    again = quantize_drafter_weights(q, "nvfp4")
    assert again["lm_head.weight"] is q["lm_head.weight"]
    assert isinstance(again["fc.weight"], Nvfp4Weight)


def test_covered_tensor_must_be_a_finite_matrix():
    with pytest.raises(CheckpointError, match="fc.weight"):
        quantize_drafter_weights({"fc.weight": jnp.ones((2, 3, 4))}, "fp8-aux")
    with pytest.raises(CheckpointError, match="non-finite"):
        quantize_drafter_weights({"lm_head.weight": jnp.array([[1.0, jnp.nan]])}, "fp8")


@pytest.mark.parametrize("bad", ["fp4", "", "int8", "bf16"])
def test_bad_tier_refused(bad):
    with pytest.raises(UserError, match="--draft-weight-quantization") as e:
        parse_tier(bad)
    assert e.value.param == "--draft-weight-quantization"
    with pytest.raises(UserError):
        quantize_drafter_weights({}, bad)


def test_parse_tier_accepts_variants():
    assert [parse_tier(t) for t in TIERS] == list(TIERS)
    assert parse_tier(" FP8_AUX ") == "fp8-aux"
    assert parse_tier("NVFP4") == "nvfp4"


# --------------------------------------------------------------------------------------------------- memory


def test_weight_bytes_per_tier_match_the_quantized_arrays():
    weights = _drafter()
    by_tier = weight_bytes_by_tier(weights)
    assert set(by_tier) == set(TIERS)
    for tier in TIERS:
        actual = sum(int(a.nbytes) for a in jax.tree.leaves(quantize_drafter_weights(weights, tier)))
        assert by_tier[tier] == actual, tier
    assert by_tier["declared"] > by_tier["fp8"] > by_tier["fp8-aux"] > by_tier["nvfp4"]
    # hand count for one tensor: lm_head [48, 32] f32 -> fp8 48*32 + 4*48, nvfp4 48*16 + 48*2 + 4
    one = {"lm_head.weight": weights["lm_head.weight"]}
    assert drafter_weight_bytes(one, "declared") == 48 * 32 * 4
    assert drafter_weight_bytes(one, "fp8") == 48 * 32 + 4 * 48
    assert drafter_weight_bytes(one, "nvfp4") == 48 * 16 + 48 * 2 + 4
    # K = 40 pads to 48 for NVFP4
    assert drafter_weight_bytes({"fc.weight": jnp.zeros((4, 40))}, "nvfp4") == 4 * 24 + 4 * 3 + 4


def test_kv_bytes_and_format_bytes():
    cfg = types.SimpleNamespace(num_layers=5, num_kv_heads=8, head_dim=128)
    assert layer_kv_bytes_per_token(cfg, "bfloat16") * 4 * 2048 == 2 * 5 * 8 * 128 * 4 * 2048 * 2
    one = types.SimpleNamespace(num_layers=1, num_kv_heads=1, head_dim=4)
    assert layer_kv_bytes_per_token(one, jnp.float32) * 3 == 96
    assert format_bytes(512) == "512 B"
    assert format_bytes(1536) == "1.50 KiB"
    assert format_bytes(300 * 2**20) == "300 MiB"
    assert format_bytes(int(1.27 * 2**30)) == "1.27 GiB"


def test_memory_preflight_refuses_and_says_what_to_change():
    weights = _drafter()
    est = estimate_drafter_memory(weights, "declared", kv_bytes=1000, scratch_bytes=0)
    assert isinstance(est, MemoryEstimate) and est.total == drafter_weight_bytes(weights, "declared") + 1000
    assert "declared" in est.describe()
    check_fits(est, target_bytes=10, free_bytes=est.total + 10)  # fits exactly
    check_fits(est, target_bytes=10**12, free_bytes=None)  # unknown free memory: no check
    with pytest.raises(UserError) as e:
        check_fits(est, target_bytes=10, free_bytes=est.total, by_tier=weight_bytes_by_tier(weights))
    msg = str(e.value)
    assert "--draft-weight-quantization nvfp4" in msg and "--max-seq-len" in msg
    assert e.value.param == "--draft-weight-quantization"


# ------------------------------------------------------------------------------------------------------ I/O


def _mixed() -> dict:
    rng = np.random.default_rng(5)
    w = jnp.asarray(rng.standard_normal((8, 40)), jnp.float32)
    return {
        "layers.0.self_attn.q_proj.weight": quantize_fp8_row(w),
        "fc.weight": quantize_nvfp4(w),  # K = 40, padded to 48
        "norm.weight": jnp.asarray(rng.standard_normal(8), jnp.float32),
        "embed.weight": jnp.asarray(rng.standard_normal((4, 8)), jnp.bfloat16),
    }


def _same(a, b) -> bool:
    a, b = np.asarray(a), np.asarray(b)
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def test_save_load_round_trip(tmp_path):
    weights = _mixed()
    path = save_quantized(tmp_path / "drafter", weights, {"tier": "nvfp4", "block_size": 16})
    assert path == tmp_path / "drafter" / "model.safetensors"
    loaded = load_quantized(tmp_path / "drafter")
    assert loaded.keys() == weights.keys()
    f, lf = weights["layers.0.self_attn.q_proj.weight"], loaded["layers.0.self_attn.q_proj.weight"]
    assert isinstance(lf, Fp8RowWeight) and _same(f.q, lf.q) and _same(f.scale, lf.scale)
    n, ln = weights["fc.weight"], loaded["fc.weight"]
    assert isinstance(ln, Nvfp4Weight) and ln.k == 40
    assert _same(n.packed, ln.packed) and _same(n.block_scale, ln.block_scale)
    assert _same(n.global_scale, ln.global_scale)
    assert _same(weights["norm.weight"], loaded["norm.weight"])
    assert _same(weights["embed.weight"], loaded["embed.weight"])
    assert read_quantized_config(path) == {"tier": "nvfp4", "block_size": 16}


def test_saved_file_is_standard_safetensors(tmp_path):
    path = save_quantized(tmp_path / "q.safetensors", _mixed())
    # header as the spec says: u64 length + JSON with real dtypes
    raw = path.read_bytes()
    (hlen,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + hlen])
    assert header["layers.0.self_attn.q_proj.weight"]["dtype"] == "F8_E4M3"
    assert header["fc.weight"]["dtype"] == "U8" and header["fc.weight"]["shape"] == [8, 24]
    assert header["fc.weight_scale"]["dtype"] == "F8_E4M3" and header["fc.weight_scale_2"]["shape"] == []
    # the safetensors library reads it (non-fp8 tensors through its numpy front end)
    with safetensors.safe_open(str(path), framework="numpy") as f:
        assert set(f.keys()) == set(header) - {"__metadata__"}
        assert "dflash_jax.quant" in f.metadata()
        np.testing.assert_array_equal(f.get_tensor("fc.weight"), np.asarray(_mixed()["fc.weight"].packed))


def test_load_plain_safetensors_from_the_library(tmp_path):
    path = tmp_path / "plain.safetensors"
    a = np.arange(12, dtype=np.float32).reshape(3, 4)
    safetensors.numpy.save_file({"fc.weight": a, "ids": np.arange(3, dtype=np.int64)}, str(path))
    loaded = load_quantized(path)
    np.testing.assert_array_equal(np.asarray(loaded["fc.weight"]), a)
    assert loaded["ids"].dtype == jnp.int64 or loaded["ids"].dtype == jnp.int32  # x64 off truncates


def test_load_refuses_a_broken_quantized_file(tmp_path):
    path = save_quantized(tmp_path / "q.safetensors", _mixed())
    tensors, meta = read_safetensors(path)
    del tensors["fc.weight_scale_2"]
    write_safetensors(tmp_path / "broken.safetensors", tensors, meta)
    with pytest.raises(CheckpointError, match="fc.weight_scale_2"):
        load_quantized(tmp_path / "broken.safetensors")
    (tmp_path / "junk.safetensors").write_bytes(b"\x01")
    with pytest.raises(CheckpointError):
        load_quantized(tmp_path / "junk.safetensors")
