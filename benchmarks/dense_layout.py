"""The dense weight layouts of `--dense-layout` at the default target's shapes, with random weights: the 30 decoder
blocks' matmuls (fused q|k|v, o, fused gate|up, down; no attention) and the LM head, for 1..32 tokens per call,
each weight read as loaded (`x @ W`, `in-out`) and as a `DenseRows` copy (`W·xᵀ`, `out-in`), through the product's
own `models.layers` functions. Median ms of 20 calls after one that compiles; prints one JSON object.

Usage: python benchmarks/dense_layout.py [--json-out F]
"""

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax.models.layers import dense, fused_gated_mlp, logits_f32, qkv_heads, to_dense_rows

H, INTER, KV, G, D, V, LAYERS = 576, 1536, 3, 3, 64, 49152, 30  # SmolLM2-135M
TOKENS = (1, 2, 4, 8, 16, 32)

ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
ap.add_argument("--json-out")
args = ap.parse_args()


def median_ms(fn, *a, n=20):
    jax.block_until_ready(fn(*a))
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*a))
        times.append((time.perf_counter() - t0) * 1e3)
    return float(np.median(times))


rng = np.random.default_rng(0)


def rand(*shape):
    return jnp.asarray(rng.standard_normal(shape, dtype=np.float32) * 0.02)


blocks = [(rand(H, KV, G + 2, D), rand(KV * G * D, H), rand(H, 2, INTER), rand(INTER, H)) for _ in range(LAYERS)]
head = rand(H, V)
layouts = {
    "in-out": (blocks, head),
    "out-in": ([tuple(to_dense_rows(w) for w in b) for b in blocks], to_dense_rows(head)),
}


@jax.jit
def stack(x, ws):
    for qkv, o, gate_up, down in ws:
        q, k, v = qkv_heads(x, qkv)
        x = x + dense(q.reshape(x.shape[0], -1), o) + 1e-3 * (k.mean() + v.mean())  # every row of q|k|v is used
        x = x + fused_gated_mlp(x, gate_up, down)
    return x


@jax.jit
def lm_head(x, w):
    return logits_f32(x, w).argmax(-1)


out = {"shapes": {"hidden": H, "intermediate": INTER, "layers": LAYERS, "vocab": V}, "blocks_ms": {}, "lm_head_ms": {}}
for name, (ws, w_head) in layouts.items():
    out["blocks_ms"][name] = {m: median_ms(stack, rand(m, H), ws) for m in TOKENS}
    out["lm_head_ms"][name] = {m: median_ms(lm_head, rand(m, H), w_head) for m in TOKENS}
    print(name, "blocks", out["blocks_ms"][name], "lm head", out["lm_head_ms"][name], flush=True)
print(json.dumps(out))
if args.json_out:
    with open(args.json_out, "w") as f:
        json.dump(out, f, indent=1)
