"""Constrained decoding is lossless under speculation: greedy output under a grammar is token for token the plain
greedy output under the same grammar, and masked sampling keeps the masked target distribution.

The reference is independent of the runner, its masks and the KV cache: every token is the argmax of a fresh
full-sequence forward with the tokens an llguidance matcher (driven directly, not through `engine.grammar`)
forbids set to -inf. Against it, at batch 1 and 4 on three schemas: plain decoding, a random drafter (its drafts
are mostly forbidden), an oracle proposing the reference continuation (full acceptance) and that oracle with a
draft per step replaced by a token the grammar forbids.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import llguidance
import numpy as np
import pytest
from flax import nnx
from scipy import stats
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

from dflash_jax.checkpoints.tokenizer import _byte_level_alphabet
from dflash_jax.engine.grammar import GrammarCompiler, grammar_from
from dflash_jax.models.drafter2 import Drafter2Model
from dflash_jax.models.layers import RandomBuilder
from dflash_jax.models.target import contiguous_kv_cache, target_forward
from dflash_jax.spec_decode.draft_choice import choose_drafts
from dflash_jax.spec_decode.runner import SpecRunner
from dflash_jax.spec_decode.sampling import SamplingArrays, processed_logprobs, speculative_accept
from dflash_jax.spec_decode.step import apply_token_mask
from dflash_jax.types import SamplingParams
from tests.conftest import tiny_drafter_config
from tests.spec_decode.test_spec_parity import MAX_LEN, OracleRunner, plain_greedy

pytestmark = pytest.mark.usefixtures("highest_matmul_precision")

N = 20
EOS = 127
PROMPTS = ([5, 17, 99, 3, 42], [42, 7, 8, 9, 10, 11], [1, 2, 3], [64, 65, 66, 67, 68, 69, 70])
SCHEMAS = {
    "object": {
        "type": "object",
        "properties": {"a": {"type": "integer"}, "b": {"enum": ["x", "yz"]}},
        "required": ["a", "b"],
        "additionalProperties": False,
    },
    "array": {"type": "array", "items": {"type": "boolean"}, "minItems": 1, "maxItems": 3},
    "string": {"type": "string", "pattern": "^[a-f]{2,6}$"},
}


class _Tok:
    """A byte-level tokenizer over the tiny models' 128 ids: id b < 127 is byte b, 127 the end of sequence."""

    def __init__(self):
        alpha = {b: c for c, b in _byte_level_alphabet().items()}
        tk = Tokenizer(models.BPE(vocab={alpha[b]: b for b in range(EOS)}, merges=[]))
        tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        tk.decoder = decoders.ByteLevel()
        tk.add_special_tokens([AddedToken("<eos>", special=True)])
        self.tk, self.eos_token_ids = tk, {EOS}


@pytest.fixture(scope="module")
def compiler(tiny_llama_cfg):
    return GrammarCompiler.from_tokenizer(_Tok(), tiny_llama_cfg.vocab_size)


def ref_matcher(compiler, grammar):
    return llguidance.LLMatcher(compiler.tokenizer, grammar, log_level=0)


def allowed(matcher, v: int) -> np.ndarray:
    bits = np.frombuffer(matcher.compute_bitmask(), np.uint8)
    return np.unpackbits(bits, bitorder="little")[:v].astype(bool)


def constrained_greedy(model, compiler, prompt: list[int], grammar: str, n: int) -> list[int]:
    """Plain greedy decoding under the grammar, one full forward per token (no runner, no cache)."""
    m, out = ref_matcher(compiler, grammar), []
    v = model.cfg.vocab_size
    for _ in range(n):
        ok = allowed(m, v)
        toks = np.zeros((1, MAX_LEN), np.int32)
        seq = [*prompt, *out]
        toks[0, : len(seq)] = seq
        g, st = nnx.split(model)
        res = target_forward(
            g,
            st,
            jnp.asarray(toks),
            jnp.arange(MAX_LEN, dtype=jnp.int32)[None],
            *contiguous_kv_cache(model.cfg, 1, MAX_LEN),
            jnp.asarray([len(seq) - 1], jnp.int32),
            kv_len=MAX_LEN,
            last_only=True,
        )
        logits = np.asarray(res.logits)[0, 0].astype(np.float64)
        t = int(np.where(ok, logits, -np.inf).argmax())
        out.append(t)
        if not m.is_stopped():
            assert m.consume_token(t)
    return out


@pytest.fixture(scope="module")
def references(tiny_target, compiler):
    grammars = {name: grammar_from("json_schema", s) for name, s in SCHEMAS.items()}
    refs = {name: [constrained_greedy(tiny_target, compiler, p, g, N) for p in PROMPTS] for name, g in grammars.items()}
    return grammars, refs


class _Recording(SpecRunner):
    """Keeps every step's verified drafts (slot -> list of (tokens emitted before the step, drafts))."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.history: dict[int, list] = {}

    def step(self, slot_list, *a, **kw):
        before = {s: len(self.slots[s].tokens) - self.slots[s].prompt_len for s in slot_list}
        res = super().step(slot_list, *a, **kw)
        for s in slot_list:
            d = list(self.last_drafts[s][: res[s].num_drafts])
            self.history.setdefault(s, []).append((before[s], d))
        return res


class _RecordingOracle(OracleRunner, _Recording):
    pass


def run(runner, compiler, prompts, grammar, n):
    """Greedy output of `prompts`, `n` tokens each, under `grammar` (or a list: one per row)."""
    runner.grammar_compiler = compiler
    grammars = grammar if isinstance(grammar, list) else [grammar] * len(prompts)
    first = runner.add_many(
        [(i, list(p), SamplingParams(grammar=g)) for i, (p, g) in enumerate(zip(prompts, grammars, strict=True))]
    )
    out = {i: list(r.tokens) for i, r in first.items()}
    active = [i for i in out if len(out[i]) < n]
    while active:
        res = runner.step(active, {i: n - len(out[i]) for i in active})
        for i, r in res.items():
            out[i] += r.tokens
        active = [i for i in active if len(out[i]) < n]
    for i in out:
        runner.release(i)
    return [out[i][:n] for i in range(len(prompts))]


def forbidden_drafts(compiler, grammar, ref: list[int], history) -> int:
    """How many steps verified a draft that the grammar forbids at its place (after the emitted reference prefix)."""
    count = 0
    for done, drafts in history:
        m = ref_matcher(compiler, grammar)
        for t in ref[:done]:
            if not m.is_stopped():
                m.consume_token(t)
        for d in drafts:
            if m.is_stopped():  # the grammar is complete: only end-of-sequence is allowed
                if d != EOS:
                    count += 1
                    break
                continue
            if not m.validate_tokens([d]):
                count += 1
                break
            m.consume_token(d)
    return count


@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("schema", list(SCHEMAS))
def test_plain_and_speculative_greedy_match_the_constrained_reference(
    tiny_target, tiny_drafter, compiler, references, schema, batch
):
    grammars, refs = references
    g, ref = grammars[schema], refs[schema][:batch]
    kw = dict(max_slots=4, max_model_len=MAX_LEN, batch_buckets=(1, 4), gamma=4)
    assert run(SpecRunner(tiny_target, None, **kw), compiler, PROMPTS[:batch], g, N) == ref
    spec = _Recording(tiny_target, tiny_drafter, **kw)
    assert run(spec, compiler, PROMPTS[:batch], g, N) == ref
    # the drafts are chosen under the grammar: every verified draft is one it allows at its place
    assert sum(forbidden_drafts(compiler, g, ref[i], spec.history[i]) for i in range(batch)) == 0
    assert sum(len(d) for i in range(batch) for _, d in spec.history[i]) > 0


@pytest.mark.parametrize("batch", [1, 4])
def test_oracle_drafts_full_and_forbidden(tiny_target, tiny_drafter, compiler, references, batch):
    grammars, refs = references
    for schema in SCHEMAS:
        g, ref = grammars[schema], refs[schema][:batch]
        kw = dict(max_slots=4, max_model_len=MAX_LEN, batch_buckets=(1, 4), gamma=4)
        full = _RecordingOracle(tiny_target, tiny_drafter, **kw)
        full.future = {i: [*p, *r] for i, (p, r) in enumerate(zip(PROMPTS, ref, strict=False))}
        assert run(full, compiler, PROMPTS[:batch], g, N) == ref
        n_steps = sum(len(h) for h in full.history.values())
        assert n_steps <= batch * -(-(N - 1) // 4)  # every draft accepted: γ tokens a step
        bad = _RecordingOracle(tiny_target, tiny_drafter, corrupt=lambda s, c: c % 3, **kw)
        bad.future = dict(full.future)
        assert run(bad, compiler, PROMPTS[:batch], g, N) == ref
        # a given draft is its position's only candidate: a forbidden one ends the draft before it, never verified
        assert sum(forbidden_drafts(compiler, g, ref[i], bad.history[i]) for i in range(batch)) == 0


def test_unconstrained_rows_share_the_batch(tiny_target, tiny_drafter, compiler, references):
    """A batch mixing constrained and free rows: the free rows are plain greedy, the constrained ones follow the
    grammar (the free rows' all-ones masks change nothing)."""
    grammars, refs = references
    kw = dict(max_slots=4, max_model_len=MAX_LEN, batch_buckets=(1, 4), gamma=4)
    r = SpecRunner(tiny_target, tiny_drafter, **kw)
    r.grammar_compiler = compiler
    sps = [SamplingParams(grammar=grammars["object"]), SamplingParams(), SamplingParams(grammar=grammars["array"])]
    first = r.add_many([(i, p, sp) for i, (p, sp) in enumerate(zip(PROMPTS, sps, strict=False))])
    out = {i: list(x.tokens) for i, x in first.items()}
    while any(len(t) < N for t in out.values()):
        for i, x in r.step(list(out), {i: 10**6 for i in out}).items():
            out[i] += x.tokens
    assert out[0][:N] == refs["object"][0]
    assert out[1][:N] == plain_greedy(tiny_target, [PROMPTS[1]], N)[0]
    assert out[2][:N] == refs["array"][2]


def test_resumed_sequence_continues_its_grammar(tiny_target, compiler, references):
    """`grammar_done`: a sequence re-prefilled with its output so far continues the grammar where it was."""
    grammars, refs = references
    g, ref = grammars["object"], refs["object"][0]
    r = SpecRunner(tiny_target, None, max_slots=1, max_model_len=MAX_LEN, batch_buckets=(1,))
    r.grammar_compiler = compiler
    k = 7
    res = r.add(0, [*PROMPTS[0], *ref[:k]], SamplingParams(grammar=g, grammar_done=k))
    out = list(res.tokens)
    while len(out) < N - k:
        out += r.step([0])[0].tokens
    assert out[: N - k] == ref[k:]


def test_masked_sampling_matches_numpy():
    """The step's mask then the processed distribution: exactly the numpy-masked, renormalized softmax; the lossless
    acceptance under it never emits a forbidden token and its emitted tokens follow that distribution."""
    rng = np.random.default_rng(0)
    b, t, v = 3, 2, 70
    logits = rng.normal(size=(b, t, v)).astype(np.float32) * 2
    allow = rng.random((b, t, v)) < 0.3
    allow[..., 5] = True
    words = (v + 31) // 32
    bits = np.zeros((b, t, words * 32), bool)
    bits[..., :v] = allow
    packed = np.packbits(bits.reshape(b, t, words, 32), axis=-1, bitorder="little").view("<i4")[..., 0]
    masked = np.asarray(apply_token_mask(jnp.asarray(logits), jnp.asarray(packed)))
    temp = 0.7
    sp = SamplingArrays(
        jnp.full((b,), temp, jnp.float32),
        jnp.zeros((b,), jnp.int32),
        jnp.ones((b,), jnp.float32),
        jnp.zeros((b,), jnp.uint32),
    )
    got = np.exp(np.asarray(processed_logprobs(jnp.asarray(masked), sp), np.float64))
    z = np.where(allow, logits / temp, -np.inf)
    ref = np.exp(z - z.max(-1, keepdims=True))
    ref /= ref.sum(-1, keepdims=True)
    np.testing.assert_allclose(got, ref, atol=1e-6)
    # acceptance of a forbidden draft (token 5 is allowed everywhere; pick a forbidden one per row)
    drafts = np.asarray([[int(np.flatnonzero(~allow[i, 0])[0])] for i in range(b)], np.int32)
    n = 4000
    seeds = jnp.arange(n, dtype=jnp.uint32)
    rep = jax.tree.map(lambda x: jnp.repeat(x, n // b + 1)[:n], sp)._replace(seed=seeds)
    idx = np.arange(n) % b
    acc, bonus = jax.jit(speculative_accept)(
        jnp.asarray(drafts[idx]),
        jnp.asarray(masked[idx]),
        jnp.ones((n,), jnp.int32),
        rep,
        jnp.zeros((n, 2), jnp.int32),
    )
    acc, bonus = np.asarray(acc), np.asarray(bonus)
    assert (acc == 0).all()
    assert allow[idx, 0, bonus].all()
    for i in range(b):  # the emitted token (the residual = p: the draft had mass 0) follows the masked p
        freq = np.bincount(bonus[idx == i], minlength=v) / (idx == i).sum()
        assert np.abs(freq - ref[i, 0]).max() < 0.05


def test_min_tokens_past_a_complete_grammar_does_not_fail(tiny_target, tiny_drafter, compiler):
    """A grammar complete before `min_tokens` leaves only the banned end-of-sequence token: the sequence goes on
    (the matcher fails and allows only end-of-sequence), and ends once the ban lifts."""
    r = SpecRunner(tiny_target, tiny_drafter, max_slots=1, max_model_len=MAX_LEN, batch_buckets=(1,), gamma=4)
    r.grammar_compiler = compiler
    sp = SamplingParams(grammar=grammar_from("regex", "ab"), min_tokens=6, stop_token_ids=(EOS,))
    out = list(r.add(0, PROMPTS[0], sp).tokens)
    while len(out) < 10:
        out += r.step([0], {0: 10})[0].tokens
    assert out[:2] == [ord("a"), ord("b")] and EOS not in out[:6] and out[6] == EOS


def test_sampled_speculative_output_follows_the_grammar(tiny_target, tiny_drafter, compiler, references):
    """Sampling under a grammar with speculation (the lossless rule over the masked target distribution): every
    emitted token is one the grammar allows at its place, checked by a reference matcher."""
    grammars, _ = references
    kw = dict(max_slots=4, max_model_len=MAX_LEN, batch_buckets=(1, 4), gamma=4)
    r = SpecRunner(tiny_target, tiny_drafter, **kw)
    r.grammar_compiler = compiler
    for name, g in grammars.items():
        sps = [SamplingParams(temperature=1.0, seed=s, grammar=g) for s in range(4)]
        first = r.add_many([(i, p, sp) for i, (p, sp) in enumerate(zip(PROMPTS, sps, strict=True))])
        out = {i: list(x.tokens) for i, x in first.items()}
        while any(len(t) < N for t in out.values()):
            for i, x in r.step(list(out), {i: 10**6 for i in out}).items():
                out[i] += x.tokens
        for i, toks in out.items():
            m = ref_matcher(compiler, g)
            for t in toks[:N]:
                assert allowed(m, tiny_target.cfg.vocab_size)[t], (name, i, toks)
                if not m.is_stopped():
                    assert m.consume_token(t)
            r.release(i)


# ------------------------------------------------------------------------------------------ a DFlash2 drafter
@pytest.fixture(scope="module")
def drafter2(tiny_llama_cfg):
    cfg = tiny_drafter_config(tiny_llama_cfg, arch="dflash2", selector_rank=8, selector_top_k=8)
    return Drafter2Model(cfg, tiny_llama_cfg.hidden_size, RandomBuilder(1, std=0.2))


@pytest.mark.parametrize("batch", [1, 4])
def test_dflash2_greedy_matches_the_constrained_reference(tiny_target, drafter2, compiler, references, batch):
    grammars, refs = references
    kw = dict(max_slots=4, max_model_len=MAX_LEN, batch_buckets=(1, 4), gamma=4)
    for schema in SCHEMAS:
        g, ref = grammars[schema], refs[schema][:batch]
        spec = _Recording(tiny_target, drafter2, **kw)
        assert run(spec, compiler, PROMPTS[:batch], g, N) == ref
        assert sum(forbidden_drafts(compiler, g, ref[i], spec.history[i]) for i in range(batch)) == 0


def next_probs(model, seq: list[int], allow: np.ndarray, temperature: float) -> np.ndarray:
    """The target's next-token distribution after `seq` at `temperature`, masked to `allow` (a fresh full
    forward, no runner)."""
    toks = np.zeros((1, MAX_LEN), np.int32)
    toks[0, : len(seq)] = seq
    g, st = nnx.split(model)
    res = target_forward(
        g,
        st,
        jnp.asarray(toks),
        jnp.arange(MAX_LEN, dtype=jnp.int32)[None],
        *contiguous_kv_cache(model.cfg, 1, MAX_LEN),
        jnp.asarray([len(seq) - 1], jnp.int32),
        kv_len=MAX_LEN,
        last_only=True,
    )
    z = np.where(allow, np.asarray(res.logits, np.float64)[0, 0] / temperature, -np.inf)
    p = np.exp(z - z.max())
    return p / p.sum()


def chi2_binned(samples: np.ndarray, probs: np.ndarray, what: str) -> None:
    """Chi-square of `samples` against `probs`, the cells expected fewer than 5 times pooled into one."""
    counts = np.bincount(samples, minlength=len(probs)).astype(np.float64)
    assert counts[probs == 0].sum() == 0, f"{what}: samples outside the support"
    exp = probs * len(samples)
    big = exp >= 5
    obs_b, exp_b = list(counts[big]), list(exp[big])
    if exp[~big & (probs > 0)].sum() > 0:
        obs_b.append(counts[~big & (probs > 0)].sum())
        exp_b.append(exp[~big & (probs > 0)].sum())
    res = stats.chisquare(obs_b, np.asarray(exp_b) * sum(obs_b) / sum(exp_b))
    assert res.pvalue > 1e-3, f"{what}: {obs_b} vs {np.round(exp_b)} (p={res.pvalue})"


def test_dflash2_sampled_constrained_spec_follows_the_masked_target(tiny_target, drafter2, compiler, monkeypatch):
    """Sampling under a grammar with a DFlash2 drafter (drafts sampled by the selector walk, re-drawn under the
    grammar with the walk's noise, verified with the masked and renormalised q): the two tokens after a forced one
    follow the masked target distribution (chi-square), the walk's noise is the one it drew with, and drafts were
    re-drawn (some walk draw was forbidden) and accepted."""
    import dflash_jax.spec_decode.runner as runner_mod

    calls = []

    def recording(g, n, width, first, drafts, extra, q=None, sampled=False):
        c = choose_drafts(g, n, width, first, drafts, extra, q, sampled)
        calls.append((np.array(drafts[:n]), np.array(extra[:n]), q and (q[0][:n], q[1][:n]), c.drafts[: c.n]))
        return c

    monkeypatch.setattr(runner_mod, "choose_drafts", recording)
    temp, rounds, b = 1.0, 200, 8
    grammar = grammar_from("regex", "x[0-9a-f]{3}")
    prompt = PROMPTS[0]
    r = SpecRunner(tiny_target, drafter2, max_slots=b, max_model_len=MAX_LEN, batch_buckets=(b,), gamma=4)
    r.grammar_compiler = compiler
    second, third, accepted = [], [], 0
    for k in range(rounds):
        sps = [SamplingParams(temperature=temp, seed=k * b + i, grammar=grammar) for i in range(b)]
        first = r.add_many([(i, prompt, sp) for i, sp in enumerate(sps)])
        assert all(x.tokens == [ord("x")] for x in first.values())
        for i, x in r.step(list(range(b)), {i: 10 for i in range(b)}).items():
            second.append(x.tokens[0])
            third.append(x.tokens[1] if len(x.tokens) > 1 else -1)
            accepted += x.num_accepted
            r.release(i)
    v = tiny_target.cfg.vocab_size
    allow = np.zeros(v, bool)
    allow[[ord(c) for c in "0123456789abcdef"]] = True
    second, third = np.asarray(second), np.asarray(third)
    chi2_binned(second, next_probs(tiny_target, [*prompt, ord("x")], allow, temp), "second token")
    # the third token where the step emitted it (its first draft was accepted), after the most frequent such second
    top = int(np.bincount(second[third >= 0]).argmax())
    rows = (second == top) & (third >= 0)
    assert rows.sum() >= 100, (rows.sum(), (third >= 0).sum())
    chi2_binned(third[rows], next_probs(tiny_target, [*prompt, ord("x"), top], allow, temp), "third token")
    assert accepted > 0
    redrawn = 0
    for drafts, noise, (ids, q), chosen in calls:
        for j in range(len(drafts)):
            if q[j].max() < 1.0:  # a sampled position: the walk's draw is argmax(log q + noise)
                with np.errstate(divide="ignore"):
                    assert ids[j][np.argmax(np.log(q[j]) + noise[j])] == drafts[j]
        redrawn += int(any(c != d for c, d in zip(chosen, drafts, strict=False)))
    assert redrawn > 0
