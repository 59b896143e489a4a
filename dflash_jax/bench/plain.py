"""`bench plain`: plain greedy decode speed at several batch sizes, and the decode step against its floor.

The decode step is timed as `bench decode` times it: the runner's own wall time per `step` (`SpecRunner.timing`),
from its host inputs to the host read of the new tokens, averaged over the timed pass of the serving engine
(`engine.offline.OfflineEngine`: 2 x batch requests per size, cycling through the prompts, EOS ignored so every
request decodes `max_tokens`; an untimed pass first compiles every shape).

The floor is what XLA reaches for the same weights and the same work per step without the rest of the step: one
jitted function (`FLOOR`) timed the same way (wall time from the call to the host read of its output, averaged
over as many calls as the decode pass made steps), at every (padded batch, KV length) shape the decode pass used,
weighted by how many steps used it. Its inputs are already on the device and it writes nothing: no cache scatter
or slot gather, no sampling, no host work. The decode step as a multiple of it (`decode_over_floor`) is the
overhead of the step around the model's own math. `matmul_floor_ms` is the same chain of weight matmuls alone
(`MATMUL_FLOOR`: no norms, RoPE or attention), the weights' streaming cost by itself.
"""

from __future__ import annotations

import math
import time
from collections import Counter
from collections.abc import Callable
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax.bench.decode import machine_info
from dflash_jax.bench.prompts import encode_prompts
from dflash_jax.builder import Models, build_runner, offline_context_len
from dflash_jax.config import TargetConfig
from dflash_jax.engine.engine import DEFAULT_MAX_NUM_BATCHED_TOKENS
from dflash_jax.engine.offline import OfflineEngine
from dflash_jax.models.layers import (
    ACTIVATIONS,
    apply_rope,
    attention_masks,
    fused_gated_mlp,
    qkv_heads,
    rms_norm,
    rope_attention_factor,
    rope_cos_sin,
    rope_inv_freq,
)
from dflash_jax.spec_decode.plan import StepPlan
from dflash_jax.types import SamplingParams

FLOOR = (
    "one jitted call per decode step of B rows, one new token each: the embedding gather; per layer RMSNorm, "
    "the fused q|k|v projection (+ q/k RMSNorm where the model has them), RoPE, attention of the new row over a "
    "KV_LEN-row K/V block and itself (read only, nothing written), o projection, residual, RMSNorm, fused gate|up, "
    "down, residual; the final RMSNorm, the lm_head and the argmax token of each row, read to the host"
)
MATMUL_FLOOR = (
    "the same weights' matmul chain alone: per layer x@qkv, o-projection of q plus k+v, residual, "
    "x@gate|up, activation x up, down, residual; then the lm_head and the argmax token of each row, read to the host"
)


FUSED_BLOCK_WEIGHTS = (
    "input_layernorm",
    "qkv_proj",
    "o_proj",
    "post_attention_layernorm",
    "gate_up_proj",
    "down_proj",
)  # a target layer's weights (`layers.declare_fused_block`)


def target_weights(model) -> dict:
    """The target's arrays as a plain pytree (what the floor functions read)."""
    names = FUSED_BLOCK_WEIGHTS + (("q_norm", "k_norm") if model.cfg.qk_norm else ())
    return {
        "embed": model.embed[...],
        "norm": model.norm[...],
        "lm_head": model.lm_head[...],
        "layers": [{n: getattr(layer, n)[...] for n in names} for layer in model.layers],
    }


def _attend(q, k_new, v_new, k_block, v_block, mask):
    """One new row per sequence over a read-only K/V block plus its own K/V (one softmax over both), without
    writing the row into the block. q [B,1,Hq,d], k/v_new [B,1,Hkv,d], blocks [B,Hkv,S,d], mask [B,1,S]."""
    b, t, hq, d = q.shape
    hkv = k_block.shape[1]
    qg = q.reshape(b, t, hkv, hq // hkv, d)
    scale = 1.0 / math.sqrt(d)
    s_block = jnp.einsum("btkgd,bksd->bkgts", qg, k_block) * scale
    s_block = jnp.where(mask[:, None, None, :, :], s_block, jnp.finfo(s_block.dtype).min)
    s_new = jnp.einsum("btkgd,btkd->bkgt", qg, k_new)[..., None] * scale
    p = jax.nn.softmax(jnp.concatenate([s_block, s_new], axis=-1).astype(jnp.float32), axis=-1).astype(v_block.dtype)
    out = jnp.einsum("bkgts,bksd->bkgtd", p[..., :-1], v_block)
    out = out + p[..., -1:] * v_new.transpose(0, 2, 1, 3)[:, :, None, :, :]
    return out.transpose(0, 3, 1, 2, 4).reshape(b, t, hq * d)


def _floor(cfg: TargetConfig, w: dict, tokens, positions, kv):
    """`FLOOR`: tokens/positions [B,1], kv: per layer (k, v) blocks [B,Hkv,S,d] -> the argmax token per row [B]."""
    eps = cfg.rms_norm_eps
    x = w["embed"][tokens]
    inv = rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
    cos, sin = rope_cos_sin(positions, inv, rope_attention_factor(cfg.rope_scaling))
    masks = attention_masks(positions - 1, kv[0][0].shape[2], cfg.layer_windows)  # block rows before the new one
    for i, lw in enumerate(w["layers"]):
        hn = rms_norm(x, lw["input_layernorm"], eps)
        q, k, v = qkv_heads(hn, lw["qkv_proj"])
        if cfg.qk_norm:
            q = rms_norm(q, lw["q_norm"], eps)
            k = rms_norm(k, lw["k_norm"], eps)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        attn = _attend(q, k, v, kv[i][0], kv[i][1], masks[cfg.window(i)])
        x = x + attn @ lw["o_proj"]
        hn = rms_norm(x, lw["post_attention_layernorm"], eps)
        x = x + fused_gated_mlp(hn, lw["gate_up_proj"], lw["down_proj"], cfg.hidden_act)
    x = rms_norm(x, w["norm"], eps)
    logits = (x @ w["lm_head"]).astype(jnp.float32)
    return jnp.argmax(logits[:, 0], axis=-1)


def _matmul_floor(cfg: TargetConfig, w: dict, tokens):
    """`MATMUL_FLOOR`: tokens [B,1] -> the argmax token per row [B]."""
    b = tokens.shape[0]
    g = cfg.num_heads // cfg.num_kv_heads
    act = ACTIVATIONS[cfg.hidden_act]
    x = w["embed"][tokens]
    for lw in w["layers"]:
        y = jnp.einsum("bti,ikgd->btkgd", x, lw["qkv_proj"])  # [B,1,kv,g+2,d]
        q, kv = y[:, :, :, :g], y[:, :, :, g : g + 1] + y[:, :, :, g + 1 : g + 2]
        x = x + (q + kv).reshape(b, 1, cfg.q_dim) @ lw["o_proj"]
        gu = jnp.einsum("bti,icf->btcf", x, lw["gate_up_proj"])
        x = x + (act(gu[:, :, 0]) * gu[:, :, 1]) @ lw["down_proj"]
    logits = (x @ w["lm_head"]).astype(jnp.float32)
    return jnp.argmax(logits[:, 0], axis=-1)


def mean_call_ms(fn: Callable[[], jax.Array], calls: int, warmup: int = 3) -> float:
    """Mean wall time (ms) of `fn()` up to the host read of its output, after `warmup` untimed calls."""
    for _ in range(warmup):
        np.asarray(fn())
    total = 0.0
    for _ in range(calls):
        t0 = time.perf_counter()
        np.asarray(fn())
        total += time.perf_counter() - t0
    return 1e3 * total / calls


def floor_ms(model, batch: int, kv_len: int, *, calls: int, matmuls_only: bool = False) -> float:
    """The floor (`FLOOR`, or `MATMUL_FLOOR` with `matmuls_only`) of a `batch`-row decode step over `kv_len` K/V
    rows: mean ms per call over `calls` calls."""
    cfg = model.cfg
    w = target_weights(model)
    dtype = w["embed"].dtype
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (batch, 1)), jnp.int32)
    if matmuls_only:
        fn = jax.jit(partial(_matmul_floor, cfg))
        return mean_call_ms(lambda: fn(w, tokens), calls)
    positions = jnp.full((batch, 1), kv_len, jnp.int32)
    shape = (batch, cfg.num_kv_heads, kv_len, cfg.head_dim)
    kv = [
        (jnp.asarray(rng.normal(size=shape), dtype), jnp.asarray(rng.normal(size=shape), dtype))
        for _ in range(cfg.num_layers)
    ]
    fn = jax.jit(partial(_floor, cfg))
    return mean_call_ms(lambda: fn(w, tokens, positions, kv), calls)


def _record_shapes(runner) -> Counter:
    """Count the (padded batch, KV length) of every decode step the runner runs from here on."""
    shapes: Counter = Counter()

    def hook(plan: StepPlan, apply: Callable[[StepPlan], object]):
        if plan.kind == "step":
            shapes[(len(plan.arrays["slot_ids"]), int(plan.static["kv_len"]))] += 1
        return apply(plan)

    runner.plan_hook = hook
    return shapes


def bench_plain(
    models: Models,
    prompts_raw: list[dict],
    *,
    batch_sizes: list[int],
    max_tokens: int,
    max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS,
    log=print,
) -> dict:
    """Plain greedy decode speed at each batch size, with the decode step's floor (see the module docstring)."""
    models = models._replace(drafter=None, draft_lm_head=None)
    tok = models.target.tokenizer
    model = models.target.model
    rows = []
    for b in batch_sizes:
        cycled = prompts_raw * ((2 * b + len(prompts_raw) - 1) // len(prompts_raw))
        batch_prompts = encode_prompts(tok, cycled[: 2 * b])
        max_len = offline_context_len(models, max(len(p) for p in batch_prompts), max_tokens)
        runner = build_runner(models, max_slots=b, max_model_len=max_len)
        with OfflineEngine(runner, tok, max_num_seqs=b, max_num_batched_tokens=max_num_batched_tokens) as llm:
            log(f"batch {b}: warm-up ...")
            llm.generate(batch_prompts, SamplingParams(), max_tokens=max_tokens, ignore_eos=True)
            runner.timing = True
            shapes = _record_shapes(runner)
            log(f"batch {b}: timed pass ...")
            outs = llm.generate(batch_prompts, SamplingParams(), max_tokens=max_tokens, ignore_eos=True)
            stats = llm.stats
        runner.plan_hook = None
        decode_ms = float(np.mean(runner.times.plain_ms))
        tokens_per_s = sum(len(o.token_ids) - 1 for o in outs) / stats.decode_s
        steps = sum(shapes.values())
        log(f"batch {b}: floor at {dict(shapes)} ...")
        floor = sum(n * floor_ms(model, pb, kv, calls=n) for (pb, kv), n in shapes.items()) / steps
        matmul_floor = sum(n * floor_ms(model, pb, kv, calls=n, matmuls_only=True) for (pb, kv), n in shapes.items())
        matmul_floor /= steps
        rows.append(
            {
                "batch_size": b,
                "tokens_per_s": tokens_per_s,
                "ms_per_step": decode_ms,
                "ms_per_token": 1e3 / tokens_per_s,
                "decode_ms": decode_ms,
                "floor_ms": floor,
                "decode_over_floor": decode_ms / floor,
                "matmul_floor_ms": matmul_floor,
                "step_shapes": [{"batch": pb, "kv_len": kv, "steps": n} for (pb, kv), n in sorted(shapes.items())],
            }
        )
        log(f"batch {b}: decode {decode_ms:.2f} ms/step, floor {floor:.2f} ms ({decode_ms / floor:.3f}x)")
    return {
        "model": models.target.model_id,
        "max_tokens": max_tokens,
        "floor": FLOOR,
        "matmul_floor": MATMUL_FLOOR,
        "results": rows,
        "machine": machine_info(),
    }
