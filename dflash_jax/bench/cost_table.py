"""The cost side of speculation at a given model shape, with random weights built on the device (no checkpoint):
plain decode, the whole speculative step and the verify alone by verify width γ, the drafter's propose (per
`--draft-weight-quantization` tier), plain decode's share of the memory-bandwidth roofline, and the speedup a
drafter of mean acceptance length τ would give at these costs.

The mixed step (`mixed`): at each of `chunk_batches`, the full-width speculative step of that many rows carrying
one new prompt's chunk of `chunk` tokens in the same call (`t_mixed_ms`), against the same step alone and the chunk
prefilled in a call of its own (`t_prefill_ms`): what a step costs the running streams while a long prompt
prefills under `--step-token-budget chunk`. Each call's chunk is a fresh prompt (no prefix-cache hit) at offset 0.

Every timing is the median wall time of `steps` calls after two untimed ones (which compile), host read included.
The runner's steps are timed through `SpecRunner.step`: `t_step_ms[γ]` verifies γ - 1 drafts the drafter proposed
in the same call (propose, verify, acceptance, context write); `t_verify_ms[γ]` verifies γ - 1 host-given drafts
(no propose); `t_decode_ms` is the plain decode step (no drafter work). Each measurement starts from freshly
prefilled rows of `prompt_len` tokens, so every one attends over the same length bucket.

The work runs in priority order and starts no further measurement after `deadline` (a `time.time()`): what
finished is reported and `timed_out` says whether anything was left.
"""

from __future__ import annotations

import time
import zlib
from collections.abc import Callable
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dflash_jax.checkpoints.export import apply_weight_tier
from dflash_jax.config import TargetConfig
from dflash_jax.kv.pages import PAGE_SIZES
from dflash_jax.models.drafter import DrafterModel, init_drafter_cache, propose_block, random_drafter_config
from dflash_jax.models.layers import ParamBuilder, contiguous_pages
from dflash_jax.models.target import TargetModel, param_count
from dflash_jax.spec_decode.oracle import GivenDraftsRunner
from dflash_jax.spec_decode.runner import bucket, kv_ladder
from dflash_jax.types import SamplingParams

QWEN3_8B = TargetConfig(
    arch="qwen3",
    vocab_size=151936,
    hidden_size=4096,
    intermediate_size=12288,
    num_layers=36,
    num_heads=32,
    num_kv_heads=8,
    head_dim=128,
    rms_norm_eps=1e-6,
    rope_theta=1e6,
    max_position_embeddings=40960,
    name="qwen3-8b-shaped-random",
)
# The same structure (qwen3, GQA 4:1, untied head) at a size a CPU compiles and runs in seconds.
TINY_QWEN3 = TargetConfig(
    arch="qwen3",
    vocab_size=512,
    hidden_size=64,
    intermediate_size=192,
    num_layers=4,
    num_heads=4,
    num_kv_heads=1,
    head_dim=16,
    rms_norm_eps=1e-6,
    rope_theta=1e6,
    max_position_embeddings=4096,
    name="tiny-qwen3-shaped-random",
)
TIERS = ("declared", "fp8", "fp8-aux", "nvfp4")
TAUS = (3.0, 4.0, 5.0, 6.5)
H200_HBM_BYTES_PER_S = 4.8e12


class DeviceRandomBuilder(ParamBuilder):
    """Random init drawn on the default device (normal(0, std) matrices, ones for norms, zeros for `init="zeros"`):
    billions of parameters in seconds, with no host copy. Each tensor's values depend on (seed, its name) only."""

    def __init__(self, seed: int = 0, std: float = 0.02, dtype=jnp.bfloat16):
        super().__init__(dtype)
        self.key = jax.random.key(seed)
        self.std = std

    def value(self, name, shape, init, axes=()):
        if init == "ones":
            return jnp.ones(shape, self.dtype)
        if init == "zeros":
            return jnp.zeros(shape, self.dtype)
        key = jax.random.fold_in(self.key, zlib.crc32(name.encode()))
        return _normal(key, shape, self.dtype, self.std)


@partial(jax.jit, static_argnames=("shape", "dtype"))
def _normal(key, shape, dtype, std):
    return (jax.random.normal(key, shape, jnp.float32) * std).astype(dtype)


def build_random(tcfg: TargetConfig, draft_layers: int, block_size: int, dtype, seed: int = 0):
    """(target, drafter): a random target of `tcfg` and a random DFlash drafter shaped for it."""
    target = TargetModel(tcfg, DeviceRandomBuilder(seed, dtype=dtype))
    return target, build_drafter(tcfg, draft_layers, block_size, dtype, seed)


def build_drafter(tcfg: TargetConfig, draft_layers: int, block_size: int, dtype, seed: int = 0) -> DrafterModel:
    cfg = random_drafter_config(tcfg, draft_layers, block_size)
    return DrafterModel(cfg, tcfg.hidden_size, DeviceRandomBuilder(seed + 1, dtype=dtype))


class _CostRunner(GivenDraftsRunner):
    """A runner whose steps verify host-given drafts (zeros) instead of the drafter's while `given` is set."""

    given = False

    def given_drafts(self, slot_list, width):
        return np.zeros((len(slot_list), width - 1), np.int32) if self.given else None


def decode_bytes(tcfg: TargetConfig, itemsize: int, batch: int, kv_len: int) -> dict[str, int]:
    """Bytes a plain decode step reads: every weight once (the embedding table: one row per sequence) and each
    sequence's K and V over the attended length `kv_len`."""
    h = tcfg.hidden_size
    weights = (param_count(tcfg) - tcfg.vocab_size * h) * itemsize + batch * h * itemsize
    if tcfg.tie_word_embeddings:
        weights += tcfg.vocab_size * h * itemsize  # the LM head is its own copy of the table
    kv = 2 * tcfg.num_layers * tcfg.num_kv_heads * tcfg.head_dim * itemsize * kv_len * batch
    return {"weights": int(weights), "kv": int(kv), "total": int(weights + kv)}


def projected_speedups(t_decode: float, t_step: dict[int, float], taus=TAUS) -> dict[str, dict]:
    """For each τ: τ / (t_step(γ) / t_decode) at the γ >= τ with the cheapest step (τ cannot exceed γ)."""
    out = {}
    for tau in taus:
        fit = {g: t for g, t in t_step.items() if g >= tau}
        if not fit:
            out[str(tau)] = {"gamma": None, "speedup": None}
            continue
        g = min(fit, key=fit.get)
        out[str(tau)] = {"gamma": g, "speedup": tau * t_decode / fit[g]}
    return out


def _median_ms(fn: Callable[[], object], steps: int) -> float:
    times = []
    for i in range(steps + 2):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        if i >= 2:  # the first calls compile
            times.append((time.perf_counter() - t0) * 1e3)
    return float(np.median(times))


def measure_cost_table(
    tcfg: TargetConfig,
    *,
    dtype,
    batches: tuple[int, ...] = (1, 8, 32, 64),
    gammas: tuple[int, ...] = tuple(range(2, 17)),
    draft_layers: int = 5,
    block_size: int = 16,
    prompt_len: int = 64,
    steps: int = 8,
    tiers: tuple[str, ...] = TIERS,
    tier_batches: tuple[int, ...] = (1, 8),
    chunks: tuple[int, ...] = (256, 2048),
    chunk_batches: tuple[int, ...] = (1, 8),
    kernel_backend: str = "xla",
    hbm_bytes_per_s: float = H200_HBM_BYTES_PER_S,
    deadline: float | None = None,
    on_update: Callable[[dict], None] | None = None,
    log=print,
) -> dict:
    """The cost table (see the module docstring) as a dict; `on_update` gets the partial table after every
    measurement."""
    t_build = time.perf_counter()
    target, drafter = build_random(tcfg, draft_layers, block_size, dtype)
    jax.block_until_ready(nnx.state(target))
    itemsize = int(np.dtype(target.embed[...].dtype).itemsize)
    gmax = max(gammas)
    max_len = prompt_len + (steps + 2) * gmax + 2 * gmax + 8
    kv_len = bucket(prompt_len + steps + 2 + gmax, kv_ladder(max_len + gmax + 1))  # acceptance of random drafts: ~0
    res: dict = {
        "target": {
            "name": tcfg.name,
            "layers": tcfg.num_layers,
            "hidden": tcfg.hidden_size,
            "heads": tcfg.num_heads,
            "kv_heads": tcfg.num_kv_heads,
            "head_dim": tcfg.head_dim,
            "intermediate": tcfg.intermediate_size,
            "vocab": tcfg.vocab_size,
            "params": param_count(tcfg),
            "dtype": str(np.dtype(target.embed[...].dtype)),
        },
        "drafter": {"layers": draft_layers, "block_size": block_size, "arch": drafter.cfg.arch},
        "build_s": time.perf_counter() - t_build,
        "gamma_max": gmax,
        "prompt_len": prompt_len,
        "kv_len": kv_len,
        "steps_per_timing": steps,
        "hbm_bytes_per_s": hbm_bytes_per_s,
        "kernel_backend": kernel_backend,
        "by_batch": {},
        "propose_by_tier": {},
        "mixed": {"chunks": list(chunks), "t_prefill_ms": {}, "by_batch": {}},
        "timed_out": False,
    }
    log(f"cost table: {tcfg.name} ({res['target']['params'] / 1e9:.2f}B params) built in {res['build_s']:.1f} s")

    def out_of_time() -> bool:
        if deadline is not None and time.time() > deadline:
            res["timed_out"] = True
            return True
        return False

    def publish():
        _summarize(res, tcfg, itemsize)
        if on_update is not None:
            on_update(res)

    runners: dict[int, _CostRunner] = {}
    mixed_runners: dict[int, _CostRunner] = {}

    def runner(b: int) -> _CostRunner:
        if b not in runners:
            runners.clear()  # one runner (and its caches) at a time
            mixed_runners.clear()
            runners[b] = _CostRunner(target, drafter, max_slots=b, max_model_len=max_len, gamma=gmax)
        return runners[b]

    def timed_step(b: int, drafts: int, given: bool) -> float:
        r = runner(b)
        r.given = given
        slots = list(range(b))
        for s in slots:
            r.release(s)
        r.add_many([(s, list(range(1, prompt_len + 1)), SamplingParams()) for s in slots])  # fresh rows
        return _median_ms(lambda: r.step(slots, None, {s: drafts for s in slots}), steps)

    def row(b: int) -> dict:
        return res["by_batch"].setdefault(str(b), {"t_step_ms": {}, "t_verify_ms": {}})

    def do_decode(b):
        row(b)["t_decode_ms"] = timed_step(b, 0, False)
        log(f"batch {b}: plain decode {row(b)['t_decode_ms']:.2f} ms")

    def do_step(b, g):
        row(b)["t_step_ms"][str(g)] = timed_step(b, g - 1, False)
        log(f"batch {b}: step γ={g} {row(b)['t_step_ms'][str(g)]:.2f} ms")

    def do_verify(b, g):
        row(b)["t_verify_ms"][str(g)] = timed_step(b, g - 1, True)
        log(f"batch {b}: verify γ={g} (given drafts) {row(b)['t_verify_ms'][str(g)]:.2f} ms")

    def mixed_runner(b: int) -> _CostRunner:
        """`b` decoding rows and one more slot for the prefilling prompt."""
        if b not in mixed_runners:
            runners.clear()
            mixed_runners.clear()
            mlen = max_len + max(chunks)
            mixed_runners[b] = _CostRunner(target, drafter, max_slots=b + 1, max_model_len=mlen, gamma=gmax)
        return mixed_runners[b]

    fresh = iter(range(1 << 30))

    def admit_chunk(r: _CostRunner, slot: int, chunk: int) -> None:
        n = next(fresh)
        r.admit([(slot, [(n * chunk + i) % (tcfg.vocab_size - 1) + 1 for i in range(chunk)], SamplingParams())])

    def do_mixed(b, chunk):
        r = mixed_runner(b)
        slots = list(range(b))
        for s in range(b + 1):
            r.release(s)
        r.add_many([(s, list(range(1, prompt_len + 1)), SamplingParams()) for s in slots])
        m = res["mixed"]["by_batch"].setdefault(str(b), {"t_mixed_ms": {}})
        if "t_step_ms" not in m:
            m["t_step_ms"] = _median_ms(lambda: r.step(slots, None, {s: gmax - 1 for s in slots}), steps)
        if str(chunk) not in res["mixed"]["t_prefill_ms"]:

            def alone():
                admit_chunk(r, b, chunk)
                out = r.prefill_step([b])
                r.release(b)
                return out

            res["mixed"]["t_prefill_ms"][str(chunk)] = _median_ms(alone, steps)

        def mixed():
            admit_chunk(r, b, chunk)
            out = r.step(slots, None, {s: gmax - 1 for s in slots}, prefill={b: chunk})
            r.release(b)
            return out

        m["t_mixed_ms"][str(chunk)] = _median_ms(mixed, steps)
        log(f"batch {b}: step γ={gmax} with a {chunk}-token prompt chunk {m['t_mixed_ms'][str(chunk)]:.2f} ms")

    prepared: dict[str, tuple] = {}  # the tier being measured: (drafter, LM head), quantized once

    def do_propose(tier, b):
        runners.clear()
        mixed_runners.clear()
        if tier not in prepared:
            prepared.clear()
            t0 = time.perf_counter()
            if tier == "declared":
                prepared[tier] = (drafter, target.lm_head[...])
            else:
                d = build_drafter(tcfg, draft_layers, block_size, dtype)
                prepared[tier] = (d, apply_weight_tier(d, target.lm_head[...], tier, kernel_backend))
            jax.block_until_ready(nnx.state(prepared[tier][0]))
            res["propose_by_tier"][tier] = {"t_propose_ms": {}, "prepare_s": time.perf_counter() - t0}
        d, head = prepared[tier]
        ms = _propose_ms(d, target.embed[...], head, b, prompt_len, kv_len, block_size, steps)
        res["propose_by_tier"][tier]["t_propose_ms"][str(b)] = ms
        log(f"propose ({tier}) batch {b}: {ms:.2f} ms")

    # priority: what the summary needs first: at the first batch plain decode, the full-width step and verify,
    # then the propose per tier; then the same three at the other batches, then the γ sweeps. Consecutive
    # measurements share a batch, so one runner serves them.
    core = {b: [(do_decode, (b,)), (do_step, (b, gmax)), (do_verify, (b, gmax))] for b in batches}
    order: list[tuple[Callable, tuple]] = core[batches[0]]
    order += [(do_propose, (t, b)) for t in tiers for b in tier_batches]
    for b in batches[1:]:
        order += core[b]
    order += [(do_mixed, (b, c)) for b in chunk_batches for c in chunks]
    for b in batches:
        order += [(do_step, (b, g)) for g in gammas if g != gmax]
        order += [(do_verify, (b, g)) for g in gammas if g != gmax]
    for fn, args in order:
        if out_of_time():
            break
        fn(*args)
        publish()
    runners.clear()
    mixed_runners.clear()
    prepared.clear()
    publish()
    return res


def _propose_ms(drafter, embed, head, b, prompt_len, kv_len, block_size, steps) -> float:
    graphdef, state = nnx.split(drafter)
    pages, num_pages = contiguous_pages(b, kv_len, PAGE_SIZES[0])
    cache = init_drafter_cache(drafter.cfg, num_pages, PAGE_SIZES[0], embed.dtype)
    anchor = jnp.zeros((b,), jnp.int32)
    start = jnp.full((b,), prompt_len, jnp.int32)
    return _median_ms(
        lambda: _propose(graphdef, state, embed, head, cache, anchor, start, pages, width=block_size, kv_len=kv_len),
        steps,
    )


@partial(jax.jit, static_argnames=("graphdef", "width", "kv_len"))
def _propose(graphdef, state, embed, head, cache, anchor, start, pages, *, width, kv_len):
    drafts, _ = propose_block(
        nnx.merge(graphdef, state), embed, head, cache, anchor, start, pages, width=width, kv_len=kv_len
    )
    return drafts


def _summarize(res: dict, tcfg: TargetConfig, itemsize: int) -> None:
    """Derived figures per batch: roofline share of plain decode, t_step/t_decode ratios, projected speedups; per
    mixed batch and chunk, the mixed step over the step alone and over the step plus the chunk's own call."""
    mixed = res["mixed"]
    for m in mixed["by_batch"].values():
        alone = {c: m["t_step_ms"] + mixed["t_prefill_ms"][c] for c in m["t_mixed_ms"] if c in mixed["t_prefill_ms"]}
        m["mixed_over_step"] = {c: t / m["t_step_ms"] for c, t in m["t_mixed_ms"].items()}
        m["mixed_over_separate"] = {c: m["t_mixed_ms"][c] / t for c, t in alone.items()}
    bw = res["hbm_bytes_per_s"]
    for b, r in res["by_batch"].items():
        t_dec = r.get("t_decode_ms")
        if t_dec is None:
            continue
        by = decode_bytes(tcfg, itemsize, int(b), res["kv_len"])
        r["decode_bytes"] = by
        r["roofline_ms"] = by["total"] / bw * 1e3
        r["hbm_roofline_fraction"] = r["roofline_ms"] / t_dec
        steps = {int(g): t for g, t in r["t_step_ms"].items()}
        r["t_step_over_t_decode"] = {str(g): t / t_dec for g, t in sorted(steps.items())}
        r["t_verify_over_t_decode"] = {g: t / t_dec for g, t in r["t_verify_ms"].items()}
        r["projected_speedup"] = projected_speedups(t_dec, steps)
        g = str(res["gamma_max"])
        r["t_step_max_over_t_decode"] = r["t_step_ms"][g] / t_dec if g in r["t_step_ms"] else None
        r["t_verify_max_over_t_decode"] = r["t_verify_ms"][g] / t_dec if g in r["t_verify_ms"] else None
        r["t_propose_ms"] = res["propose_by_tier"].get("declared", {}).get("t_propose_ms", {}).get(b)
