"""The runner over a KV page pool, against an independent reference (fresh full-sequence forwards over pages of
their own, `test_spec_parity.plain_greedy`): chunked prefill, prefix-cache sharing (released and live), preemption
under a pool too small for every sequence, and no leaked pages."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dflash_jax.engine.offline import OfflineEngine
from dflash_jax.kv.pages import PagePool
from dflash_jax.kv.sizing import dense_pool
from dflash_jax.models.drafter import propose_hidden
from dflash_jax.models.layers import Pages
from dflash_jax.spec_decode.runner import SpecRunner
from dflash_jax.types import SamplingParams
from tests.spec_decode.test_spec_parity import IdTokenizer, plain_greedy

pytestmark = pytest.mark.usefixtures("highest_matmul_precision")  # f32 results meet f32 references

MAX_LEN = 128
N_NEW = 12


def uncached(drafter):
    """A one-sequence pool without prefix caching, sized as the runner's default."""
    return dense_pool(1, MAX_LEN, drafter.cfg.block_size, prefix_caching=False)


def prompt(n: int, seed: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(1, 60, size=n)]


def decode(runner, slot, ids, n=N_NEW, sampling=None):
    out = runner.add(slot, ids, sampling or SamplingParams()).tokens
    while len(out) < n:
        out += runner.step([slot], {slot: n - len(out)})[slot].tokens
    return out[:n]


@pytest.fixture(scope="module")
def shared():
    base = prompt(40, 0)
    return [base + prompt(7, 1), base + prompt(11, 2)]


@pytest.fixture(scope="module")
def reference(tiny_target, shared):
    return plain_greedy(tiny_target, shared, N_NEW, tmax=MAX_LEN)


def test_chunked_prefill_equals_the_reference(tiny_target, tiny_drafter, shared, reference):
    r = SpecRunner(tiny_target, tiny_drafter, max_slots=2, max_model_len=MAX_LEN, max_num_batched_tokens=16)
    first = r.add_many([(0, shared[0], SamplingParams()), (1, shared[1], SamplingParams())])
    assert first[0].tokens == [] and set(r.prefilling) == {0, 1}
    calls = 1
    while r.prefilling:
        r.prefill_step()
        calls += 1
    assert calls == 4  # 51 prompt tokens in chunks of 16
    r.release(0), r.release(1)
    assert [decode(r, i, shared[i]) for i in (0, 1)] == reference
    whole = SpecRunner(
        tiny_target,
        tiny_drafter,
        max_slots=1,
        max_model_len=MAX_LEN,
        pool=uncached(tiny_drafter),
    )
    drafts = []
    for runner in (r, whole):
        runner.release(0)
        runner.pages.free_seq(0)
        runner.add(0, shared[1], SamplingParams())
        runner.step([0], {0: N_NEW})
        drafts.append(runner.last_drafts[0].tolist())
    assert drafts[0] == drafts[1]  # the drafter context written chunk by chunk equals the one-pass prefill's


def test_prefix_pages_are_shared_and_outputs_unchanged(tiny_target, tiny_drafter, shared, reference):
    r = SpecRunner(tiny_target, tiny_drafter, max_slots=2, max_model_len=MAX_LEN)
    assert decode(r, 0, shared[0]) == reference[0]
    r.release(0)
    hits = r.pages.stats.prefix_hits
    assert decode(r, 0, shared[1]) == reference[1]
    assert r.pages.stats.prefix_hits - hits == 32  # the two full pages of the 40-token common prefix
    # live sharing: both sequences hold the prefix pages at once
    r.release(0)
    r.add(0, shared[0], SamplingParams())
    r.add(1, shared[1], SamplingParams())
    t0, t1 = r.pages.table(0), r.pages.table(1)
    assert t0[:2] == t1[:2] and r.pages.refcount(t0[0]) == 2
    outs = {0: [], 1: []}
    while min(len(v) for v in outs.values()) < N_NEW - 1:
        for s, res in r.step([0, 1], {0: N_NEW, 1: N_NEW}).items():
            outs[s] += res.tokens
    r.release(0), r.release(1)
    assert r.pages.used == 0
    base_drafts = SpecRunner(
        tiny_target,
        tiny_drafter,
        max_slots=1,
        max_model_len=MAX_LEN,
        pool=uncached(tiny_drafter),
    )
    assert decode(base_drafts, 0, shared[1]) == reference[1]


def test_preemption_resumes_with_identical_output(tiny_target, tiny_drafter):
    prompts = [prompt(20 + 3 * i, 10 + i) for i in range(4)]
    want = plain_greedy(tiny_target, prompts, 40, tmax=MAX_LEN)
    # 4 sequences of up to 29 + 40 + γ positions need 4 x 5 pages of 16; the pool has 12
    runner = SpecRunner(tiny_target, tiny_drafter, max_slots=4, max_model_len=MAX_LEN, pool=PagePool(13, 16))
    with OfflineEngine(runner, IdTokenizer()) as llm:
        outs = llm.generate(prompts, max_tokens=40)
        preemptions = llm.engine.stats.preemptions
    assert preemptions > 0
    assert [o.token_ids for o in outs] == want
    assert runner.pages.used == 0 and not runner.slots


def test_pallas_attention_backend_decodes_the_reference(
    tiny_target, tiny_llama_cfg, drafter_factory, shared, reference
):
    """The Pallas kernel (interpret mode on CPU) for the target's attention and the drafter's context attention
    (merged with its in-block attention by log-sum-exp; the kernel needs head_dim >= 16, and a sliding-window
    layer checks the merged ranges): the same tokens and the same drafts as the XLA path."""
    drafter = drafter_factory(tiny_llama_cfg, head_dim=16, layer_attn=((0, False), (6, True)))
    runs = {}
    for backend in ("xla", "pallas"):
        r = SpecRunner(tiny_target, drafter, max_slots=1, max_model_len=MAX_LEN, attention_backend=backend)
        assert r.attention_backend == ("xla" if backend == "xla" else "interpret")  # CPU: the kernel interpreted
        out = r.add(0, shared[1], SamplingParams()).tokens
        drafts = []
        for _ in range(2):
            out += r.step([0], {0: N_NEW})[0].tokens
            drafts.append(r.last_drafts[0].tolist())
        runs[backend] = (out, drafts)
    assert runs["pallas"] == runs["xla"]
    assert runs["pallas"][0] == reference[1][: len(runs["pallas"][0])]


@pytest.mark.parametrize("window", [3, 8, 12])
def test_pallas_drafter_window_limits_the_block_too(tiny_llama_cfg, drafter_factory, window):
    """A sliding-window drafter layer over the page pools: the Pallas path (interpret mode) gives the XLA path's
    block hidden states for windows smaller than, equal to and larger than the block of 8, so the window limits the
    block's own keys as well as the context's."""
    cfg = tiny_llama_cfg
    drafter = drafter_factory(cfg, head_dim=16, block_size=8, layer_attn=((0, False), (window, True)))
    page, n_pages, kv_len = 16, 6, 64
    keys = jax.random.split(jax.random.key(3), 2 * len(drafter.layers) + 1)
    shape = (n_pages, drafter.cfg.num_kv_heads, page, drafter.cfg.head_dim)
    cache = tuple(
        (jax.random.normal(keys[2 * i], shape), jax.random.normal(keys[2 * i + 1], shape))
        for i in range(len(drafter.layers))
    )
    embed = jax.random.normal(keys[-1], (cfg.vocab_size, cfg.hidden_size)) * 0.5
    table = jnp.array([[1, 2, 3, 4], [5, 4, 3, 2]], jnp.int32)
    anchor, start = jnp.array([5, 9], jnp.int32), jnp.array([37, 20], jnp.int32)

    def hidden(backend):
        pages = Pages(table, backend, interpret=backend == "pallas")
        return propose_hidden(drafter, embed, cache, anchor, start, pages, width=8, kv_len=kv_len)

    np.testing.assert_allclose(np.asarray(hidden("pallas")), np.asarray(hidden("xla")), rtol=2e-4, atol=2e-4)
