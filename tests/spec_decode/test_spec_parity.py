"""Greedy speculative decoding is lossless: token for token the plain greedy output.

The reference continuation is computed independently of the KV cache and of the runner: every token is the argmax
of a fresh full-sequence forward over prompt + tokens so far. Against it, SpecRunner at batch 1 and batch 4 (prompt
lengths 3..14) with
  (a) a random-weight drafter (near-zero acceptance),
  (b) an oracle drafter proposing the target's own continuation (full acceptance),
  (c) the oracle corrupted at scheduled draft positions, so that every accept length 0..γ-1 occurs and each step's
      accept length is exactly the one the corruption dictates,
and the offline engine (`engine.offline.OfflineEngine`, what `generate` and `bench decode` run) with EOS /
max_tokens landing inside an accepted block (the tokens after it are dropped), and its greedy speculative output
equal to its plain output under continuous batching with the real draft-count controller.
Finally the drafter wiring: the drafts the runner holds after each step equal a from-scratch drafter proposal on
the committed context (losslessness alone would not notice a wrongly fed drafter).
"""

from __future__ import annotations

from collections import defaultdict
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dflash_jax.engine.offline import OfflineEngine
from dflash_jax.engine.types import DraftController
from dflash_jax.models.target import contiguous_kv_cache, target_forward
from dflash_jax.spec_decode.control.controller import Controller
from dflash_jax.spec_decode.oracle import GivenDraftsRunner
from dflash_jax.spec_decode.runner import SpecRunner
from dflash_jax.types import SamplingParams

pytestmark = pytest.mark.usefixtures("highest_matmul_precision")  # f32 results meet f32 references

N_NEW = 24
MAX_LEN = 64
UNCAPPED = 10**6  # max_new hint that never limits the drafts (the output is truncated by the caller instead)
PROMPT_LENS = (3, 9, 5, 14)


def plain_greedy(model, prompts: list[list[int]], n: int, tmax: int = MAX_LEN) -> list[list[int]]:
    """Greedy continuation by full-sequence forwards from an empty cache (no incremental decoding)."""
    graphdef, state = nnx.split(model)
    b = len(prompts)
    seqs = [list(p) for p in prompts]
    pos = jnp.broadcast_to(jnp.arange(tmax, dtype=jnp.int32), (b, tmax))
    for _ in range(n):
        toks = np.zeros((b, tmax), np.int32)
        for i, s in enumerate(seqs):
            toks[i, : len(s)] = s
        last = jnp.asarray([len(s) - 1 for s in seqs], jnp.int32)
        out = target_forward(
            graphdef,
            state,
            jnp.asarray(toks),
            pos,
            *contiguous_kv_cache(model.cfg, b, tmax),
            last,
            kv_len=tmax,
            last_only=True,
        )
        for i, t in enumerate(np.asarray(out.logits)[:, 0].argmax(-1)):
            seqs[i].append(int(t))
    return [s[len(p) :] for s, p in zip(seqs, prompts, strict=True)]


class OracleRunner(GivenDraftsRunner):
    """Test-only drafter: proposes the known plain-greedy continuation (`future[slot]` = prompt + continuation),
    optionally corrupting draft index `corrupt(slot, call)` (None = no corruption) of the drafts of the call-th
    step."""

    def __init__(self, *args, corrupt=None, **kw):
        super().__init__(*args, **kw)
        self.future: dict[int, list[int]] = {}
        self.corrupt = corrupt
        self.calls: dict[int, int] = defaultdict(int)
        self.corrupted: dict[int, list[int | None]] = defaultdict(list)  # per slot, per proposal

    def given_drafts(self, slot_list: list[int], width: int) -> np.ndarray:
        out = np.zeros((len(slot_list), width - 1), np.int32)
        v = self.cfg.vocab_size
        for i, s in enumerate(slot_list):
            start, seq = self.slots[s].start, self.future[s]
            d = [seq[p] if p < len(seq) else 0 for p in range(start + 1, start + width)]
            j = self.corrupt(s, self.calls[s]) if self.corrupt else None
            if j is not None and j < len(d):
                d[j] = (d[j] + 1) % v
            self.corrupted[s].append(j)
            self.calls[s] += 1
            out[i] = d
        return out

    def step(self, slot_list, *args, **kw):
        calls = {s: self.calls[s] for s in slot_list}
        res = super().step(slot_list, *args, **kw)
        for s in slot_list:  # a plain step (no slot drafted) asked for no drafts: it counts as an uncorrupted call
            if self.calls[s] == calls[s]:
                self.corrupted[s].append(None)
                self.calls[s] += 1
        return res


def run_batch(runner: SpecRunner, prompts: list[list[int]], n: int, cap: bool = False, choose=None):
    """Drive the runner like the engine does; returns (tokens per slot truncated to n, step results per slot).
    With `cap`, the runner is told how many tokens each slot still wants (it then drafts fewer at the end);
    without, every step verifies full blocks (one static width, fewer compilations) and the surplus is cut.
    `choose(active)` -> {slot: drafts} plays the engine's controller (the step's `num_drafts`)."""
    first = runner.add_many([(i, p, SamplingParams()) for i, p in enumerate(prompts)])
    out = {i: list(r.tokens) for i, r in first.items()}
    steps: dict[int, list] = {i: [] for i in out}
    active = [i for i in out if len(out[i]) < n]
    while active:
        max_new = {i: (n - len(out[i])) if cap else UNCAPPED for i in active}
        res = runner.step(active, max_new, choose(active) if choose else None)
        assert set(res) == set(active)
        for i, r in res.items():
            assert len(r.tokens) == r.num_accepted + 1 and r.num_accepted <= r.num_drafts
            out[i] += r.tokens
            steps[i].append(r)
        active = [i for i in active if len(out[i]) < n]
    for i in out:
        runner.release(i)
    return {i: t[:n] for i, t in out.items()}, steps


@pytest.fixture(scope="module")
def prompts(tiny_llama_cfg) -> list[list[int]]:
    rng = np.random.default_rng(0)
    return [rng.integers(0, tiny_llama_cfg.vocab_size - 1, size=n).tolist() for n in PROMPT_LENS]


@pytest.fixture(scope="module")
def reference(tiny_target, prompts) -> list[list[int]]:
    ref = plain_greedy(tiny_target, prompts, N_NEW + 8)
    for r in ref:
        assert len(set(r[:N_NEW])) >= 4, f"degenerate reference continuation {r}"
    return ref


def batches(prompts):
    return {"batch1": [prompts[1]], "batch4": prompts}


@pytest.mark.parametrize("batch", ["batch1", "batch4"])
def test_plain_runner_matches_reference(tiny_target, prompts, reference, batch):
    ps = batches(prompts)[batch]
    refs = [reference[prompts.index(p)][:N_NEW] for p in ps]
    runner = SpecRunner(tiny_target, None, max_slots=len(ps), max_model_len=MAX_LEN, batch_buckets=(len(ps),))
    out, steps = run_batch(runner, ps, N_NEW)
    assert [out[i] for i in range(len(ps))] == refs
    assert all(r.num_drafts == 0 and len(r.tokens) == 1 for s in steps.values() for r in s)


@pytest.mark.parametrize("batch", ["batch1", "batch4"])
def test_random_drafter_matches_plain(tiny_target, tiny_drafter, prompts, reference, batch):
    ps = batches(prompts)[batch]
    refs = [reference[prompts.index(p)][:N_NEW] for p in ps]
    runner = SpecRunner(tiny_target, tiny_drafter, max_slots=len(ps), max_model_len=MAX_LEN, batch_buckets=(len(ps),))
    assert runner.gamma == tiny_drafter.cfg.block_size == 4
    out, steps = run_batch(runner, ps, N_NEW)
    assert [out[i] for i in range(len(ps))] == refs
    assert all(r.num_drafts == runner.gamma - 1 for s in steps.values() for r in s)  # it did speculate


@pytest.mark.parametrize("batch", ["batch1", "batch4"])
def test_oracle_drafter_accepts_everything(tiny_target, tiny_drafter, prompts, reference, batch):
    ps = batches(prompts)[batch]
    runner = OracleRunner(tiny_target, tiny_drafter, max_slots=len(ps), max_model_len=MAX_LEN, batch_buckets=(len(ps),))
    for i, p in enumerate(ps):
        runner.future[i] = p + reference[prompts.index(p)]
    out, steps = run_batch(runner, ps, N_NEW)
    g = runner.gamma
    for i, p in enumerate(ps):
        assert out[i] == reference[prompts.index(p)][:N_NEW]
        assert [(r.num_drafts, r.num_accepted, len(r.tokens)) for r in steps[i]] == [(g - 1, g - 1, g)] * len(steps[i])
        assert len(steps[i]) == -(-(N_NEW - 1) // g)


@pytest.mark.parametrize("batch,gamma", [("batch1", None), ("batch4", None), ("batch4", 3)])
def test_corrupted_oracle_gives_every_accept_length(tiny_target, tiny_drafter, prompts, reference, batch, gamma):
    """Proposal k of slot s has draft index (k + s) mod γ corrupted (index γ-1 = none corrupted); at batch 4 the
    slots other than 0 also verify a varying number of drafts per step (0..γ-1, in the same call as slot 0's full
    block). Every step's accept length is exactly min(corrupted index, drafts verified), all of 0..γ-1 occur, and
    the output is the plain greedy output. γ=3 pins the verify width below the drafter's block size."""
    ps = batches(prompts)[batch]
    counter: dict[int, int] = defaultdict(int)

    def corrupt(slot, call):
        j = (call + slot) % runner.gamma
        return None if j == runner.gamma - 1 else j

    def choose(slot_list):
        chosen = {}
        for s in slot_list:
            chosen[s] = runner.gamma - 1 if s == 0 else (counter[s] * (s + 1)) % runner.gamma
            counter[s] += 1
        return chosen

    runner = OracleRunner(
        tiny_target,
        tiny_drafter,
        max_slots=len(ps),
        max_model_len=MAX_LEN,
        batch_buckets=(len(ps),),
        gamma=gamma,
        corrupt=corrupt,
    )
    g = runner.gamma
    assert g == (gamma or tiny_drafter.cfg.block_size)
    for i, p in enumerate(ps):
        runner.future[i] = p + reference[prompts.index(p)]
    out, steps = run_batch(runner, ps, N_NEW + 8, choose=choose)
    seen, drafts_seen = set(), set()
    for i, p in enumerate(ps):
        assert out[i] == reference[prompts.index(p)][: N_NEW + 8], f"slot {i}"
        for k, r in enumerate(steps[i]):
            j = runner.corrupted[i][k]  # the proposal verified at step k was made before it
            expect = r.num_drafts if j is None or j >= r.num_drafts else j
            assert r.num_accepted == expect, f"slot {i} step {k}: corrupted {j}, drafts {r.num_drafts}"
            assert r.accepted_mask == [t < expect for t in range(r.num_drafts)]
            seen.add(r.num_accepted)
            drafts_seen.add(r.num_drafts)
    assert seen == set(range(g))
    if len(ps) > 1:
        assert drafts_seen == set(range(g))


# ------------------------------------------------------------------------------------------- stops in a block
class OvershootingOracle(OracleRunner):
    """Oracle that always verifies γ-1 drafts, ignoring how many tokens are still wanted (so a step can overshoot
    max_tokens and the engine must drop the surplus)."""

    def num_drafts(self, slot_list, max_new, requested=None):
        return {s: self.gamma - 1 for s in slot_list}


class Recording:
    """Wraps runner.step to keep what the runner returned before the engine dropped anything."""

    def __init__(self, runner):
        self.runner, self.raw = runner, []
        self._step = runner.step
        runner.step = self.step

    def step(self, slots, max_new=None, num_drafts=None, no_propose=()):
        res = self._step(slots, max_new, num_drafts, no_propose)
        self.raw.extend(r.tokens for r in res.values())
        return res


class IdTokenizer:
    """Token ids as text ("12 7 9 "); `eos` are the stop ids. Enough of `TokenizerLike` for the engine."""

    def __init__(self, eos=()):
        self.eos_token_ids = set(eos)

    def encode(self, text, add_special_tokens=True):
        return [int(t) for t in text.split()]

    def decode(self, ids):
        return "".join(f"{int(t)} " for t in ids)


def offline(runner, prompt, max_tokens, eos=(), **kw):
    """One greedy request through the offline engine; returns (output, the run's stats)."""
    with OfflineEngine(runner, IdTokenizer(eos), **kw) as llm:
        (out,) = llm.generate([prompt], max_tokens=max_tokens)
        return out, llm.stats


@pytest.fixture(scope="module")
def stop_runner(tiny_target, tiny_drafter):
    return OvershootingOracle(tiny_target, tiny_drafter, max_slots=1, max_model_len=MAX_LEN, batch_buckets=(1,))


def test_eos_inside_an_accepted_block_truncates_exactly(stop_runner, prompts, reference):
    g = stop_runner.gamma
    prompt, ref = prompts[2], reference[2]
    # out[0] comes from prefill; then step t emits out[1+g(t-1) .. g*t], the last one being the bonus.
    # Pick a stop token that first occurs at an accepted-draft index (not the bonus), past the first block.
    cands = [i for i in range(g + 1, N_NEW) if (i - 1) % g != g - 1 and ref[i] not in ref[:i]]
    assert cands, f"no usable stop position in {ref}"
    i = cands[0]
    stop_runner.future[0] = prompt + ref
    rec = Recording(stop_runner)
    out, _ = offline(stop_runner, prompt, N_NEW, eos={ref[i]})
    assert out.token_ids == ref[: i + 1] and out.finish_reason == "stop"
    assert out.text == "".join(f"{t} " for t in ref[:i])  # the stop token's text is not emitted
    emitted = 1 + sum(len(t) for t in rec.raw)
    assert emitted > i + 1  # the runner produced tokens past the stop; they were dropped
    assert ref[i] in rec.raw[-1][:-1]  # the stop arrived as an accepted draft, not as the bonus


def test_eos_as_first_token(stop_runner, prompts, reference):
    stop_runner.future[0] = prompts[0] + reference[0]
    out, stats = offline(stop_runner, prompts[0], N_NEW, eos={reference[0][0]})
    assert out.token_ids == reference[0][:1] and stats.steps == 0


@pytest.mark.parametrize("max_tokens", [2, 7, 11])
def test_max_tokens_inside_an_accepted_block(stop_runner, prompts, reference, max_tokens):
    stop_runner.future[0] = prompts[3] + reference[3]
    rec = Recording(stop_runner)
    out, _ = offline(stop_runner, prompts[3], max_tokens)
    assert out.token_ids == reference[3][:max_tokens] and out.finish_reason == "length"
    assert 1 + sum(len(t) for t in rec.raw) > max_tokens  # the last block overshot and was cut


def test_max_tokens_respected_by_the_real_runner(tiny_target, tiny_drafter, prompts, reference):
    """Without the cap override the runner drafts only what is wanted; the output is the same prefix."""
    runner = OracleRunner(tiny_target, tiny_drafter, max_slots=1, max_model_len=MAX_LEN, batch_buckets=(1,))
    runner.future[0] = prompts[3] + reference[3]
    rec = Recording(runner)
    out, _ = offline(runner, prompts[3], 7)
    assert out.token_ids == reference[3][:7]
    assert [len(t) for t in rec.raw] == [4, 2]  # prefill's 1 + a full block + a block with just the 1 draft wanted


def test_offline_greedy_speculative_equals_plain_under_continuous_batching(
    tiny_target, tiny_drafter, prompts, reference
):
    """Four requests over two slots (the later ones are admitted while others decode), the real rung controller
    choosing the draft counts: the speculative outputs are the plain ones, and both are the reference."""
    refs = [r[:N_NEW] for r in reference]
    plain = SpecRunner(tiny_target, None, max_slots=2, max_model_len=MAX_LEN)
    with OfflineEngine(plain, IdTokenizer(), max_num_seqs=2) as llm:
        plain_out = [o.token_ids for o in llm.generate(prompts, max_tokens=N_NEW)]
        assert llm.stats.max_running == 2 and not llm.stats.spec_results
    ctl = Controller.from_flags(block_size=tiny_drafter.cfg.block_size)
    spec = SpecRunner(tiny_target, tiny_drafter, max_slots=2, max_model_len=MAX_LEN, gamma=ctl.gamma)
    with OfflineEngine(spec, IdTokenizer(), max_num_seqs=2, controller=ctl) as llm:
        outs = llm.generate(prompts, max_tokens=N_NEW)
        stats = llm.stats
    assert plain_out == refs
    assert [o.token_ids for o in outs] == refs
    assert stats.max_running == 2 and stats.spec_results  # it did speculate, two at a time
    assert all(r.num_drafts <= ctl.gamma - 1 for r in stats.spec_results)


# ------------------------------------------------------------------------------------------- drafter wiring
@partial(jax.jit, static_argnames=("tgraph", "dgraph", "width"))
def fresh_proposal(tgraph, tstate, dgraph, dstate, tokens, start, anchor, *, width):
    """Drafts for the block at `start` from a fresh drafter cache filled from one full-sequence target forward
    over `tokens` [1, C] (rows at or after `start` are padding; the context mask must hide them)."""
    from dflash_jax.models.drafter import contiguous_drafter_cache, propose_block, write_context

    target, drafter = nnx.merge(tgraph, tstate), nnx.merge(dgraph, dstate)
    c = tokens.shape[1]
    pos = jnp.arange(c, dtype=jnp.int32)[None]
    tcache, pages = contiguous_kv_cache(target.cfg, 1, c)
    _, hidden, _ = target(tokens, pos, tcache, pages, capture=drafter.cfg.target_layer_ids, kv_len=c)
    cache = write_context(drafter, contiguous_drafter_cache(drafter.cfg, 1, c)[0], hidden, pos, pages)
    drafts, _ = propose_block(
        drafter, target.embed[...], target.lm_head[...], cache, anchor, start, pages, width=width, kv_len=c
    )
    return drafts[0]


@pytest.mark.parametrize("pending", [64, 2])
def test_runner_drafts_equal_the_drafter_on_the_committed_context(tiny_target, tiny_drafter, prompts, pending):
    """The runner's drafter context cache is right: the drafts every speculative step verifies equal a
    from-scratch proposal whose context is the target's hidden states of every committed token before the anchor
    (one full-sequence forward), i.e. context rows are written once per committed token at their absolute
    positions, rows of rejected drafts never leak in, and the taps of plainly decoded tokens (kept pending, then
    caught up in one pass when the sequence speculates again or the pending buffer is full) land where they belong.
    With 2 pending rows the plain runs below overflow the buffer and flush it mid-run."""
    g = tiny_drafter.cfg.block_size
    tgraph, tstate = nnx.split(tiny_target)
    dgraph, dstate = nnx.split(tiny_drafter)

    def expected_drafts(seq: list[int]) -> list[int]:
        start = len(seq) - 1  # the anchor's position; its own hidden state is not context yet
        toks = np.zeros((1, MAX_LEN), np.int32)
        toks[0, :start] = seq[:start]
        d = fresh_proposal(
            tgraph,
            tstate,
            dgraph,
            dstate,
            jnp.asarray(toks),
            jnp.asarray([start], jnp.int32),
            jnp.asarray([seq[-1]], jnp.int32),
            width=g,
        )
        return np.asarray(d).tolist()

    import dflash_jax.spec_decode.runner as runner_mod

    ps = [prompts[0], prompts[3]]
    old, runner_mod.PENDING = runner_mod.PENDING, pending
    try:
        runner = SpecRunner(tiny_target, tiny_drafter, max_slots=2, max_model_len=MAX_LEN, batch_buckets=(2,))
    finally:
        runner_mod.PENDING = old
    assert runner.state.pending.shape[1] == pending
    first = runner.add_many([(i, p, SamplingParams()) for i, p in enumerate(ps)])
    seqs = {i: p + first[i].tokens for i, p in enumerate(ps)}
    checked = 0
    for drafts in (3, 0, 0, 3, 0, 0, 0, 0, 0, 3, 3, 0, 3):  # speculative and plain steps
        before = {i: list(s) for i, s in seqs.items()}
        res = runner.step([0, 1], {0: UNCAPPED, 1: UNCAPPED}, {0: drafts, 1: drafts})
        for i, r in res.items():
            assert r.num_drafts == drafts
            if drafts:
                assert runner.last_drafts[i].tolist() == expected_drafts(before[i]), f"slot {i}"
                checked += 1
            seqs[i] += r.tokens
    assert checked == 10


def test_offline_greedy_equals_plain_when_suspended_sequences_skip_the_drafter(
    tiny_target, tiny_drafter, prompts, reference
):
    """A controller that suspends every sequence for three steps, then lets it draft for three: suspended steps
    are plain width-1 steps without drafter work, and the first step after each resume catches the drafter
    context up. Greedy output stays the plain reference."""
    refs = [r[:N_NEW] for r in reference]

    class Flipping(DraftController):
        def __init__(self):
            self.steps = 0

        def _plain(self) -> bool:
            return (self.steps // 3) % 2 == 1

        def decide(self, ids):
            self.steps += 1
            return {i: (0 if self._plain() else 3) for i in ids}

        def observe(self, seq_id, num_drafts, accepted=0):
            pass

        def is_suspended(self, seq_id):
            return self._plain()

    spec = SpecRunner(tiny_target, tiny_drafter, max_slots=2, max_model_len=MAX_LEN, gamma=4)
    rec = Recording(spec)
    with OfflineEngine(spec, IdTokenizer(), max_num_seqs=2, controller=Flipping()) as llm:
        outs = llm.generate(prompts, max_tokens=N_NEW)
        stats = llm.stats
    assert [o.token_ids for o in outs] == refs
    assert stats.spec_results and any(len(t) == 1 for t in rec.raw)  # both kinds of step ran


def _cast(model, dtype):
    graphdef, state = nnx.split(model)
    return nnx.merge(graphdef, jax.tree.map(lambda x: x.astype(dtype), state))


class FlipEvery(DraftController):
    """A controller that speculates for `n` steps, then suspends every sequence for `n` (plain width-1 steps, no
    drafter work), and so on: every resume catches the drafter context up."""

    def __init__(self, n: int):
        self.n, self.steps = n, 0

    def _plain(self) -> bool:
        return (self.steps // self.n) % 2 == 1

    def decide(self, ids):
        self.steps += 1
        return {i: (0 if self._plain() else 3) for i in ids}

    def observe(self, seq_id, num_drafts, accepted=0):
        pass

    def is_suspended(self, seq_id):
        return self._plain()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("batch", [1, 4, 8])
def test_greedy_parity_with_suspend_and_resume(tiny_target, tiny_drafter, dtype, batch):
    """Speculative greedy output (a controller flipping between speculative and suspended steps mid-sequence)
    equals the plain runner's, token for token, in f32 and in bf16 (both runners in that dtype, caches included)."""
    dt = jnp.dtype(dtype)
    target, drafter = _cast(tiny_target, dt), _cast(tiny_drafter, dt)
    rng = np.random.default_rng(batch)
    ps = [rng.integers(0, 255, size=int(n)).tolist() for n in rng.integers(3, 15, size=batch)]
    plain = SpecRunner(target, None, max_slots=batch, max_model_len=MAX_LEN)
    assert plain.tcache[0][0].dtype == dt
    with OfflineEngine(plain, IdTokenizer(), max_num_seqs=batch) as llm:
        ref = [o.token_ids for o in llm.generate(ps, max_tokens=N_NEW)]
    spec = SpecRunner(target, drafter, max_slots=batch, max_model_len=MAX_LEN, gamma=4)
    assert spec.tcache[0][0].dtype == spec.dcache[0][0].dtype == spec.state.pending.dtype == dt
    rec = Recording(spec)
    with OfflineEngine(spec, IdTokenizer(), max_num_seqs=batch, controller=FlipEvery(2)) as llm:
        outs = [o.token_ids for o in llm.generate(ps, max_tokens=N_NEW)]
    assert outs == ref
    assert any(len(t) == 1 for t in rec.raw) and spec.device_calls["step"] > 0
