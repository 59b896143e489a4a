"""Loading a sharded HF checkpoint tensor by tensor: values and dtypes, what reaches the device, mesh placement,
and (with DFLASH_JAX_LOAD_RSS=1) the host peak RSS while loading a Llama-3.2-1B-shaped bf16 checkpoint.

The checkpoints are synthetic: HF Llama names, [out, in] matrices, random bfloat16 values, written in several
shards with a `model.safetensors.index.json`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import save_file

from dflash_jax.checkpoints.loader import load_target
from dflash_jax.models.layers import Placement, unfused_block
from dflash_jax.parallel.mesh import make_mesh
from dflash_jax.parallel.rules import MeshPlacement, shard_state
from tests.tinymodels import write_byte_tokenizer

BF16 = np.dtype(ml_dtypes.bfloat16)
LLAMA_3_2_1B = dict(hidden=2048, layers=16, inter=8192, vocab=128256, heads=32, kv_heads=8, tied=True)


def hf_tensor_shapes(hidden, layers, inter, vocab, heads, kv_heads, tied) -> dict[str, tuple[int, ...]]:
    hd = hidden // heads
    shapes = {"model.embed_tokens.weight": (vocab, hidden), "model.norm.weight": (hidden,)}
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (hidden,)
        shapes[p + "post_attention_layernorm.weight"] = (hidden,)
        shapes[p + "self_attn.q_proj.weight"] = (heads * hd, hidden)
        shapes[p + "self_attn.k_proj.weight"] = (kv_heads * hd, hidden)
        shapes[p + "self_attn.v_proj.weight"] = (kv_heads * hd, hidden)
        shapes[p + "self_attn.o_proj.weight"] = (hidden, heads * hd)
        shapes[p + "mlp.gate_proj.weight"] = (inter, hidden)
        shapes[p + "mlp.up_proj.weight"] = (inter, hidden)
        shapes[p + "mlp.down_proj.weight"] = (hidden, inter)
    if not tied:
        shapes["lm_head.weight"] = (vocab, hidden)
    return shapes


def random_bf16(rng: np.random.Generator, shape) -> np.ndarray:
    """Random finite bfloat16 values of both signs in [2^-8, 2) (drawn as bit patterns: no f32 temporary)."""
    bits = rng.integers(0x3B80, 0x4000, size=shape, dtype=np.uint16) | (
        rng.integers(0, 2, size=shape, dtype=np.uint16) << 15
    )
    return bits.view(BF16)


def write_sharded_checkpoint(path: Path, *, shard_bytes: int, seed: int = 0, keep: bool = True, **shape) -> dict:
    """A HF Llama directory with random bf16 weights in shards of about `shard_bytes` (a tensor never split), plus
    the index, config.json and a byte-level tokenizer. Returns {name: array} (or {} with keep=False) and writes
    the shard sizes to `path / "shards.json"`."""
    path.mkdir(parents=True, exist_ok=True)
    write_byte_tokenizer(path)
    rng = np.random.default_rng(seed)
    shapes = hf_tensor_shapes(**shape)
    groups, cur, size = [], [], 0
    for name, s in shapes.items():
        n = int(np.prod(s)) * 2
        if cur and size + n > shard_bytes:
            groups.append(cur)
            cur, size = [], 0
        cur.append(name)
        size += n
    groups.append(cur)
    kept, weight_map, sizes = {}, {}, {}
    for k, names in enumerate(groups):
        fname = f"model-{k + 1:05d}-of-{len(groups):05d}.safetensors"
        tensors = {n: random_bf16(rng, shapes[n]) for n in names}
        save_file(tensors, str(path / fname), metadata={"format": "pt"})
        sizes[fname] = (path / fname).stat().st_size
        weight_map.update(dict.fromkeys(names, fname))
        if keep:
            kept.update(tensors)
        del tensors
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (path / "shards.json").write_text(json.dumps(sizes))
    (path / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["LlamaForCausalLM"],
                "model_type": "llama",
                "vocab_size": shape["vocab"],
                "hidden_size": shape["hidden"],
                "intermediate_size": shape["inter"],
                "num_hidden_layers": shape["layers"],
                "num_attention_heads": shape["heads"],
                "num_key_value_heads": shape["kv_heads"],
                "rms_norm_eps": 1e-5,
                "rope_theta": 500000.0,
                "tie_word_embeddings": shape["tied"],
                "max_position_embeddings": 2048,
                "torch_dtype": "bfloat16",
            }
        )
    )
    return kept


TINY = dict(hidden=64, layers=3, inter=128, vocab=260, heads=4, kv_heads=2)


@pytest.fixture(scope="module", params=[False, True], ids=["untied", "tied"])
def ckpt(request, tmp_path_factory):
    path = tmp_path_factory.mktemp("sharded")
    tensors = write_sharded_checkpoint(path, shard_bytes=60_000, seed=3, tied=request.param, **TINY)
    assert len(json.loads((path / "shards.json").read_text())) >= 3  # really sharded
    return path, tensors


def ours_from_file(tensors: dict, tied: bool) -> dict[str, np.ndarray]:
    """Our parameter paths -> the file's values in our layout ([in, out] matrices; the tied head = embed.T)."""
    out = {
        "embed": tensors["model.embed_tokens.weight"],
        "norm": tensors["model.norm.weight"],
        "lm_head": (tensors["model.embed_tokens.weight"] if tied else tensors["lm_head.weight"]).T,
    }
    for name, w in tensors.items():
        if name.startswith("model.layers."):
            parts = name.split(".")  # model.layers.{i}[.self_attn|.mlp].{leaf}.weight
            out[f"layers.{parts[2]}.{parts[-2]}"] = w.T if w.ndim == 2 else w
    return out


def params_of(model) -> dict[str, jax.Array]:
    """Parameter paths -> values, each layer's fused q|k|v and gate|up split back into the file's tensors."""
    out = {".".join(str(p) for p in path): v[...] for path, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}
    for i, layer in enumerate(model.layers):
        del out[f"layers.{i}.qkv_proj"], out[f"layers.{i}.gate_up_proj"]
        out.update({f"layers.{i}.{n}": w for n, w in unfused_block(layer).items()})
    return out


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32, jnp.float16], ids=["bf16", "f32", "f16"])
def test_loaded_weights_equal_the_files_values(ckpt, dtype):
    """Every parameter equals the file's tensor (transposed to [in, out]) converted to the serving dtype, and has
    that dtype; bf16 -> bf16 is bit-exact."""
    path, tensors = ckpt
    tied = "lm_head.weight" not in tensors
    lt = load_target(str(path), dtype)
    got, want = params_of(lt.model), ours_from_file(tensors, tied)
    assert got.keys() == want.keys()
    for k, w in want.items():
        g = got[k]
        assert g.dtype == jnp.dtype(dtype), k
        np.testing.assert_array_equal(np.asarray(g), w.astype(np.float32).astype(jnp.dtype(dtype)), err_msg=k)


class RecordingPlacement(Placement):
    """The default device, recording what each `put` received from the host."""

    def __init__(self):
        self.puts: list[tuple[str, tuple[int, ...]]] = []

    def put(self, x, sharding):
        self.puts.append((str(x.dtype), tuple(x.shape)))
        return super().put(x, sharding)


def test_each_tensor_reaches_the_device_once_as_stored(ckpt):
    """One host->device transfer per file tensor, in the file's dtype and [out, in] shape: no host upcast to
    f32, no host transpose (both happen on the device)."""
    path, tensors = ckpt
    rec = RecordingPlacement()
    lt = load_target(str(path), jnp.float32, rec)
    assert sorted(rec.puts) == sorted(("bfloat16", w.shape) for w in tensors.values())
    assert lt.model.layers[0].qkv_proj[...].dtype == jnp.float32


def test_loading_onto_a_mesh_places_each_tensor_on_its_shards(ckpt):
    """With a MeshPlacement every parameter is loaded with the sharding that `shard_state` (the runner's placement)
    gives it, so placing the loaded state moves nothing, and the values are the file's."""
    path, tensors = ckpt
    tied = "lm_head.weight" not in tensors
    mesh = make_mesh(2, num_heads=TINY["heads"], num_kv_heads=TINY["kv_heads"])
    lt = load_target(str(path), jnp.bfloat16, MeshPlacement(mesh))
    state = nnx.state(lt.model, nnx.Param)
    placed = shard_state(state, mesh)
    for (p, v), (_, v2) in zip(nnx.to_flat_state(state), nnx.to_flat_state(placed), strict=True):
        a, b = v[...], v2[...]
        assert a.sharding.is_equivalent_to(b.sharding, a.ndim), p
    qkv = lt.model.layers[1].qkv_proj[...]  # split on the KV heads
    assert len(qkv.sharding.device_set) == 2 and qkv.sharding.spec == jax.sharding.PartitionSpec(None, "tp")
    want = ours_from_file(tensors, tied)
    for k, g in params_of(lt.model).items():
        np.testing.assert_array_equal(np.asarray(g), want[k], err_msg=k)


# ------------------------------------------------------------------------------------------- host peak RSS
MEASURE = textwrap.dedent(
    """
    import json, sys

    def kib(key):
        for line in open("/proc/self/status"):
            if line.startswith(key):
                return int(line.split()[1]) * 1024

    import jax, jax.numpy as jnp
    from flax import nnx
    from dflash_jax.checkpoints.loader import load_target

    jnp.zeros(1).block_until_ready()
    base = kib("VmRSS:")
    lt = load_target(sys.argv[1], jnp.bfloat16)
    leaves = jax.tree.leaves(nnx.state(lt.model))
    jax.block_until_ready(leaves)
    print(json.dumps({"baseline": base, "peak": kib("VmHWM:"), "model_bytes": sum(x.nbytes for x in leaves)}))
    """
)


@pytest.mark.skipif(not os.environ.get("DFLASH_JAX_LOAD_RSS"), reason="set DFLASH_JAX_LOAD_RSS=1 (writes ~2.5 GB)")
def test_host_peak_rss_loading_a_1b_bf16_checkpoint(tmp_path):
    """Llama-3.2-1B shapes in ~1 GB bf16 shards, loaded in a fresh process in bf16 on the CPU backend. On CPU the
    loaded model itself lives in host memory, so the loader's own host footprint is the peak minus the process
    baseline minus the loaded arrays' bytes; it must stay under 1.3x the largest shard."""
    write_sharded_checkpoint(tmp_path, shard_bytes=1 << 30, keep=False, **LLAMA_3_2_1B)
    largest = max(json.loads((tmp_path / "shards.json").read_text()).values())
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": ""}
    res = subprocess.run(
        [sys.executable, "-c", MEASURE, str(tmp_path)], capture_output=True, text=True, env=env, check=True
    )
    m = json.loads(res.stdout.strip().splitlines()[-1])
    overhead = m["peak"] - m["baseline"] - m["model_bytes"]
    gib = 2**30
    print(
        f"\nbaseline {m['baseline'] / gib:.2f} GiB, peak {m['peak'] / gib:.2f} GiB, loaded arrays "
        f"{m['model_bytes'] / gib:.2f} GiB, loader overhead {overhead / gib:.2f} GiB, "
        f"largest shard {largest / gib:.2f} GiB"
    )
    assert overhead <= 1.3 * largest
