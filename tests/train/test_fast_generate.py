"""Training-data generation (`train.data.generate_shard`, on-device blocks of decode steps over length buckets):
its greedy rows equal the serving runner's plain greedy decoding token for token, across block and bucket
boundaries, and a row stops at its end-of-sequence token while the others go on."""

from __future__ import annotations

from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dflash_jax.config import TargetConfig
from dflash_jax.models.layers import RandomBuilder
from dflash_jax.models.target import TargetModel
from dflash_jax.spec_decode.runner import SpecRunner
from dflash_jax.train.data import GEN_BLOCK, MIN_GEN_BUCKET, DataConfig, gen_kv_bucket, generate_shard
from dflash_jax.types import SamplingParams

pytestmark = pytest.mark.usefixtures("highest_matmul_precision")  # f32 results meet f32 references

TINY = TargetConfig(
    arch="llama",
    vocab_size=64,
    hidden_size=32,
    intermediate_size=64,
    num_layers=3,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
)
PROMPTS = [[1, 2, 3], [4, 5, 6, 7, 8, 9], [10, 11]]
MAX_PROMPT, MAX_NEW = 8, 2 * GEN_BLOCK + 6  # three blocks; the attention bucket grows past MIN_GEN_BUCKET


def _plain_greedy(model, prompts, n_tokens):
    """Greedy tokens of the serving runner without a drafter (prefill's first token, then one per step)."""
    r = SpecRunner(model, None, max_slots=len(prompts), max_model_len=MAX_PROMPT + n_tokens + 4)
    slots = list(range(len(prompts)))
    first = r.add_many([(s, p, SamplingParams()) for s, p in zip(slots, prompts, strict=True)])
    out = {s: list(first[s].tokens) for s in slots}
    for _ in range(n_tokens - 1):
        for s, res in r.step(slots).items():
            out[s] += res.tokens
    return [out[s] for s in slots]


def _target(dtype):
    return TargetModel(TINY, RandomBuilder(3, std=0.3, dtype=dtype))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_greedy_rows_equal_the_plain_runner(dtype):
    model = _target(dtype)
    ref = _plain_greedy(model, PROMPTS, MAX_NEW)
    lt = SimpleNamespace(model=model, cfg=TINY, tokenizer=SimpleNamespace(eos_token_ids=set()))
    cfg = DataConfig(taps=(0, 2), max_prompt=MAX_PROMPT, max_new=MAX_NEW, sampled_fraction=0.0, store_taps=False)
    d = generate_shard(lt, cfg, PROMPTS, 0)
    for i, p in enumerate(PROMPTS):
        assert d["lengths"][i] == len(p) + MAX_NEW
        assert d["tokens"][i, : len(p)].tolist() == p
        assert d["tokens"][i, len(p) : len(p) + MAX_NEW].tolist() == ref[i]
        assert d["loss_mask"][i].sum() == MAX_NEW and d["loss_mask"][i, len(p)] == 1
    assert len({tuple(r) for r in ref}) == len(ref)  # the rows differ: a mix-up of rows would show


def test_a_row_stops_at_its_end_token_and_the_others_go_on():
    model = _target(jnp.float32)
    ref = _plain_greedy(model, PROMPTS, MAX_NEW)
    # an end token the second row emits inside the second block, and that the other rows never emit
    others = set(ref[0]) | set(ref[2])
    cut = next(j for j, t in enumerate(ref[1]) if j > GEN_BLOCK and t not in others and t not in ref[1][:j])
    eos = ref[1][cut]
    lt = SimpleNamespace(model=model, cfg=TINY, tokenizer=SimpleNamespace(eos_token_ids={eos}))
    cfg = DataConfig(taps=(1,), max_prompt=MAX_PROMPT, max_new=MAX_NEW, sampled_fraction=0.0, store_taps=True)
    d = generate_shard(lt, cfg, PROMPTS, 0)
    p1 = len(PROMPTS[1])
    assert d["lengths"][1] == p1 + cut + 1  # the end token is part of the response
    assert d["tokens"][1, p1 : p1 + cut + 1].tolist() == ref[1][: cut + 1]
    assert not d["tokens"][1, p1 + cut + 1 :].any() and not d["taps"][1, p1 + cut + 1 :].any()
    assert d["taps"][1, p1 + cut].any()
    for i in (0, 2):
        assert d["tokens"][i, len(PROMPTS[i]) : len(PROMPTS[i]) + MAX_NEW].tolist() == ref[i]


def test_length_bucket():
    assert gen_kv_bucket(1, 1000) == MIN_GEN_BUCKET
    assert gen_kv_bucket(MIN_GEN_BUCKET + 1, 1000) == 2 * MIN_GEN_BUCKET
    assert gen_kv_bucket(900, 1000) == 1000
    assert gen_kv_bucket(MIN_GEN_BUCKET, MIN_GEN_BUCKET - 8) == MIN_GEN_BUCKET - 8


def test_other_row_and_sampled_counts_reuse_the_compiled_programs():
    """Row counts and sampled-row counts are padded to powers of two: a build whose shards differ in them (every
    shard draws its own sampled rows) compiles a bounded set of programs rather than new ones per shard."""
    from dflash_jax.train.data import _decode_block

    model = _target(jnp.float32)
    lt = SimpleNamespace(model=model, cfg=TINY, tokenizer=SimpleNamespace(eos_token_ids=set()))
    cfg = DataConfig(taps=(), max_prompt=MAX_PROMPT, max_new=GEN_BLOCK, sampled_fraction=0.0, store_taps=False)
    d3 = generate_shard(lt, cfg, PROMPTS, 0, force_sampled=np.array([True, True, True]))
    compiled = _decode_block._cache_size()
    d4 = generate_shard(lt, cfg, [*PROMPTS, [12, 13]], 1, force_sampled=np.array([True] * 4))
    assert _decode_block._cache_size() == compiled  # 3 -> 4 rows, 3 -> 4 sampled rows: the same buckets
    assert len(d3["tokens"]) == 3 and len(d4["tokens"]) == 4  # padding rows are dropped
    assert d4["lengths"].tolist() == [len(p) + GEN_BLOCK for p in [*PROMPTS, [12, 13]]]


def test_a_repeated_sampled_row_index_draws_the_same_token():
    """The sampled-row list is padded with repeats of an entry; a repeat draws with that row's key at its
    position, so the tokens equal those of the unpadded list."""
    from dflash_jax.spec_decode.sampling import SamplingArrays
    from dflash_jax.train.data import _pick_rows

    n, vocab = 4, 64
    logits = jax.random.normal(jax.random.key(0), (n, 1, vocab)) * 0.1  # flat: a draw is rarely the argmax
    sp = SamplingArrays(
        temperature=jnp.full((n,), 0.9, jnp.float32),
        top_k=jnp.zeros((n,), jnp.int32),
        top_p=jnp.ones((n,), jnp.float32),
        seed=jnp.arange(n, dtype=jnp.uint32) + 7,
    )
    pos = jnp.arange(n, dtype=jnp.int32)[:, None] + 5
    plain = _pick_rows(logits, sp, pos, jnp.asarray([1, 2, 3], jnp.int32))
    padded = _pick_rows(logits, sp, pos, jnp.asarray([1, 2, 3, 1], jnp.int32))
    greedy = _pick_rows(logits, sp, pos, jnp.zeros((0,), jnp.int32))
    assert padded.tolist() == plain.tolist()
    assert plain[0, 0] == greedy[0, 0] and plain[1:].tolist() != greedy[1:].tolist()  # rows 1-3 did sample
