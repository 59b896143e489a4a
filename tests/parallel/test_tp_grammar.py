"""Constrained decoding under drafter tensor parallelism, on 8 fake CPU devices: the drafts a DFlash or DFlash2
drafter proposes under drafter TP are re-chosen under each row's grammar (`spec_decode.draft_choice`) as on one
rank, so greedy constrained speculative output equals greedy constrained plain decoding (one device, no drafter),
and no verified draft is one the grammar forbids at its place.

The models are the TP test models (`test_parallel_tp`, `test_tp_dflash2`: 8 KV heads, vocab 128); the grammars are
`test_grammar`'s schemas over its byte-level tokenizer, one per row of a batch of 4.
"""

from __future__ import annotations

import numpy as np
import pytest

import dflash_jax.spec_decode.runner as runner_mod
from dflash_jax.engine.grammar import GrammarCompiler, grammar_from
from dflash_jax.parallel.mesh import make_mesh
from dflash_jax.spec_decode.draft_choice import choose_drafts
from dflash_jax.spec_decode.runner import SpecRunner
from dflash_jax.types import SamplingParams
from tests.parallel.test_parallel_tp import TCFG, _leaning_target, _models
from tests.parallel.test_tp_dflash2 import _e2e_drafter
from tests.spec_decode.test_grammar import PROMPTS, SCHEMAS, _Recording, _Tok, forbidden_drafts, run

pytestmark = pytest.mark.usefixtures("highest_matmul_precision")

N = 16
MAX_LEN = 64
GRAMMARS = [
    grammar_from("json_schema", SCHEMAS["object"]),
    grammar_from("json_schema", SCHEMAS["array"]),
    grammar_from("json_schema", SCHEMAS["string"]),
    grammar_from("regex", "[a-z]{3}(, [a-z]{3}){1,4}"),
]


@pytest.fixture(scope="module")
def compiler():
    return GrammarCompiler.from_tokenizer(_Tok(), TCFG.vocab_size)


def _run(runner: SpecRunner, compiler, batch: int) -> list[list[int]]:
    """Greedy output of the first `batch` prompts, row i under `GRAMMARS[i]`, `N` tokens each."""
    return run(runner, compiler, PROMPTS[:batch], GRAMMARS[:batch], N)


def _plain(compiler, batch: int) -> list[list[int]]:
    r = SpecRunner(_leaning_target(), None, max_slots=4, max_model_len=MAX_LEN, batch_buckets=(1, 4))
    return _run(r, compiler, batch)


@pytest.mark.parametrize("arch", ["dflash", "dflash2"])
@pytest.mark.parametrize(("tp", "batch"), [(2, 4), (8, 1), (8, 4)])
def test_constrained_greedy_under_drafter_tp_equals_constrained_plain(compiler, monkeypatch, arch, tp, batch):
    drafter = _models()[1] if arch == "dflash" else _e2e_drafter()
    walks = []

    def recording(g, n, width, first, drafts, extra, q=None, sampled=False):
        c = choose_drafts(g, n, width, first, drafts, extra, q, sampled)
        walks.append((np.array(drafts[: c.n]), c.drafts[: c.n]))
        return c

    monkeypatch.setattr(runner_mod, "choose_drafts", recording)
    spec = _Recording(
        _leaning_target(),
        drafter,
        max_slots=4,
        max_model_len=MAX_LEN,
        batch_buckets=(1, 4),
        gamma=3,
        mesh=make_mesh(tp),
        draft_tp="auto",
    )
    assert spec.draft_tp == tp and spec.draft_mesh is not None
    got = _run(spec, compiler, batch)
    ref = _plain(compiler, batch)
    assert got == ref
    for i in range(batch):  # every verified draft is one the row's grammar allows at its place
        assert forbidden_drafts(compiler, GRAMMARS[i], ref[i], spec.history[i]) == 0
    verified = sum(len(d) for i in range(batch) for _, d in spec.history[i])
    assert verified > 0 and walks
    # the grammar changed some of the drafter's drafts (the re-choice ran on the TP proposal)
    assert any((proposed != chosen).any() for proposed, chosen in walks)


def test_constrained_sampled_under_drafter_tp_follows_the_grammar(compiler):
    """Sampling under a grammar with a DFlash2 drafter under drafter TP (drafts re-drawn under the grammar with the
    walk's noise): every emitted token is one the grammar allows at its place (a reference matcher replays them),
    and the seeded output is the one-device runner's."""
    import llguidance

    from tests.spec_decode.test_grammar import allowed

    def sampled(mesh):
        r = SpecRunner(
            _leaning_target(),
            _e2e_drafter(),
            max_slots=4,
            max_model_len=MAX_LEN,
            batch_buckets=(1, 4),
            gamma=3,
            mesh=mesh,
            draft_tp="auto",
        )
        r.grammar_compiler = compiler
        sps = [SamplingParams(temperature=1.0, seed=7 + i, grammar=GRAMMARS[i]) for i in range(4)]
        first = r.add_many([(i, list(PROMPTS[i]), sps[i]) for i in range(4)])
        out = {i: list(x.tokens) for i, x in first.items()}
        while any(len(t) < N for t in out.values()):
            for i, x in r.step(list(out), {i: 10**6 for i in out}).items():
                out[i] += x.tokens
        return [out[i][:N] for i in range(4)]

    got = sampled(make_mesh(4))
    for i, toks in enumerate(got):
        m = llguidance.LLMatcher(compiler.tokenizer, GRAMMARS[i], log_level=0)
        for t in toks:
            assert allowed(m, TCFG.vocab_size)[t], (i, toks)
            if not m.is_stopped():
                assert m.consume_token(t)
    assert got == sampled(None)
