"""`min_tokens`: the ending tokens are masked from the target's distribution until `min_tokens` tokens are generated,
identically in plain and speculative steps (so speculation stays lossless), at T = 0 and T > 0.

The reference is independent of the runner and of the KV cache: every token is the argmax of a fresh full-sequence
forward, with the banned ids' logits set to -inf while fewer than `min_tokens` tokens have been generated.
"""

from __future__ import annotations

import asyncio

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dflash_jax.engine.engine import Engine
from dflash_jax.engine.types import GenerationRequest
from dflash_jax.models.target import contiguous_kv_cache, target_forward
from dflash_jax.spec_decode.runner import SpecRunner
from dflash_jax.types import SamplingParams
from tests.spec_decode.test_spec_parity import IdTokenizer, OracleRunner

MAX_LEN = 64
N = 16


def greedy_reference(model, prompt: list[int], n: int, banned=(), min_tokens: int = 0) -> list[int]:
    graphdef, state = nnx.split(model)
    seq = list(prompt)
    pos = jnp.arange(MAX_LEN, dtype=jnp.int32)[None]
    for g in range(n):
        toks = np.zeros((1, MAX_LEN), np.int32)
        toks[0, : len(seq)] = seq
        out = target_forward(
            graphdef,
            state,
            jnp.asarray(toks),
            pos,
            *contiguous_kv_cache(model.cfg, 1, MAX_LEN),
            jnp.asarray([len(seq) - 1], jnp.int32),
            kv_len=MAX_LEN,
            last_only=True,
        )
        logits = np.asarray(out.logits)[0, 0].copy()
        if g < min_tokens:
            logits[list(banned)] = -np.inf
        seq.append(int(logits.argmax()))
    return seq[len(prompt) :]


@pytest.fixture(scope="module")
def case(tiny_target):
    prompts = [[5, 17, 99, 3, 42], [42, 7, 8, 9, 10, 11]]
    free = [greedy_reference(tiny_target, p, N) for p in prompts]
    min_tokens = 10
    # ban the first k distinct tokens row 0 would emit, with k such that the mask matters past the prefill's token
    for k in range(2, 10):
        banned = tuple(dict.fromkeys(free[0]))[:k]
        ref0 = greedy_reference(tiny_target, prompts[0], N, banned, min_tokens)
        if ref0 != greedy_reference(tiny_target, prompts[0], N, banned, 1):
            break
    first_only = greedy_reference(tiny_target, prompts[0], N, banned, 1)  # the ban on the prefill's token only
    assert ref0 != first_only and set(first_only[1:min_tokens]) & set(banned)
    assert not set(ref0[:min_tokens]) & set(banned)
    ref = [ref0, free[1]]
    sps = [SamplingParams(min_tokens=min_tokens, stop_token_ids=banned), SamplingParams()]
    return prompts, sps, ref, [first_only, free[1]]


def _run(runner, prompts, sps, n):
    first = runner.add_many([(i, p, sp) for i, (p, sp) in enumerate(zip(prompts, sps, strict=True))])
    out = {i: list(r.tokens) for i, r in first.items()}
    active = list(out)
    while active:
        for i, r in runner.step(active, {i: 10**6 for i in active}).items():
            out[i] += r.tokens
        active = [i for i in active if len(out[i]) < n]
    return [out[i][:n] for i in range(len(prompts))]


def test_plain_and_speculative_steps_mask_the_banned_ids_until_min_tokens(tiny_target, tiny_drafter, case):
    prompts, sps, ref, _ = case
    plain = SpecRunner(tiny_target, None, max_slots=2, max_model_len=MAX_LEN, batch_buckets=(2,))
    assert _run(plain, prompts, sps, N) == ref
    spec = SpecRunner(tiny_target, tiny_drafter, max_slots=2, max_model_len=MAX_LEN, batch_buckets=(2,))
    assert _run(spec, prompts, sps, N) == ref


def test_drafts_of_a_banned_id_are_rejected(tiny_target, tiny_drafter, case):
    """The oracle drafts what the target would emit without the mask after the first token (banned ids before
    min_tokens included): the verify must reject those and emit the masked target's token, exactly the
    reference."""
    prompts, sps, ref, free = case
    runner = OracleRunner(tiny_target, tiny_drafter, max_slots=2, max_model_len=MAX_LEN, batch_buckets=(2,))
    for i, p in enumerate(prompts):
        runner.future[i] = p + free[i]
    first = runner.add_many([(i, p, sp) for i, (p, sp) in enumerate(zip(prompts, sps, strict=True))])
    out = {i: list(r.tokens) for i, r in first.items()}
    rejected = 0
    for _ in range(6):
        for i, r in runner.step([0, 1], {0: 10**6, 1: 10**6}).items():
            out[i] += r.tokens
            rejected += i == 0 and r.num_accepted < r.num_drafts
    assert out[0][:N] == ref[0][: len(out[0][:N])] and rejected > 0
    assert out[1][:N] == free[1][: len(out[1][:N])]


def test_sampled_rows_never_draw_a_banned_id_before_min_tokens(tiny_target, tiny_drafter):
    """T = 1 over 32 rows: the 4 most likely first tokens are banned for 3 tokens; none of them appears in the first
    3 tokens of any row (plain and speculative), and they do appear without the ban."""
    prompt = [5, 17, 99, 3, 42]
    b = 32
    runner_p = SpecRunner(tiny_target, None, max_slots=b, max_model_len=MAX_LEN, batch_buckets=(b,))
    unbanned = _run(runner_p, [prompt] * b, [SamplingParams(1.0, seed=s) for s in range(b)], 3)
    counts = np.bincount([t for o in unbanned for t in o], minlength=tiny_target.cfg.vocab_size)
    banned = tuple(int(t) for t in np.argsort(-counts)[:4])
    assert sum(counts[list(banned)]) >= 8  # without the ban they are drawn
    sps = [SamplingParams(1.0, seed=s, min_tokens=3, stop_token_ids=banned) for s in range(b)]
    for drafter in (None, tiny_drafter):
        r = SpecRunner(tiny_target, drafter, max_slots=b, max_model_len=MAX_LEN, batch_buckets=(b,))
        out = _run(r, [prompt] * b, sps, 3)
        assert not any(t in banned for o in out for t in o)


def test_engine_masks_eos_and_stop_token_ids_until_min_tokens(tiny_target, tiny_drafter, case):
    """Through the engine: EOS (the tokenizer's) and the request's stop_token_ids are the banned ids; with
    ignore_eos only the stop ids. Speculative output equals the masked reference."""
    prompts, _, ref, _ = case
    banned = case[1][0].stop_token_ids
    eos, stop = banned[0], banned[1:]
    spec = SpecRunner(tiny_target, tiny_drafter, max_slots=2, max_model_len=MAX_LEN, batch_buckets=(2,))

    async def run(req: GenerationRequest):
        eng = Engine(spec, IdTokenizer(eos=(eos,)), log_interval_s=0)
        await eng.start()
        try:
            return await eng.submit(req).collect()
        finally:
            await eng.stop(join_device=True)

    req = GenerationRequest(prompt_ids=prompts[0], max_tokens=10, stop_token_ids=tuple(stop), min_tokens=10)
    assert asyncio.run(run(req)).token_ids == ref[0][:10]
    # with ignore_eos EOS is not an ending token: only the stop ids are masked (the reference bans only them)
    ref_stop = greedy_reference(tiny_target, prompts[0], 10, tuple(stop), 10)
    req = GenerationRequest(prompts[0], 10, stop_token_ids=tuple(stop), min_tokens=10, ignore_eos=True)
    assert asyncio.run(run(req)).token_ids == ref_stop


def test_engine_refuses_more_ending_tokens_than_it_can_mask():
    from dflash_jax.errors import UserError
    from dflash_jax.testing.fake_runner import make_fake
    from dflash_jax.types import MAX_ENDING_TOKENS

    runner, tok = make_fake()

    async def submit(n: int):
        eng = Engine(runner, tok, log_interval_s=0)
        await eng.start()
        try:
            req = GenerationRequest(tok.encode("hi"), 4, stop_token_ids=tuple(range(10, 10 + n)), min_tokens=2)
            return await eng.submit(req).collect()
        finally:
            await eng.stop(join_device=True)

    n_eos = len(tok.eos_token_ids)
    assert asyncio.run(submit(MAX_ENDING_TOKENS - n_eos)).finish_reason
    with pytest.raises(UserError, match=f"more than {MAX_ENDING_TOKENS} stop token ids") as e:
        asyncio.run(submit(MAX_ENDING_TOKENS - n_eos + 1))
    assert e.value.param == "stop_token_ids"
