"""`stop_token_ids`, `min_tokens` and `n` on a real runner (tiny random Llama + random drafter, speculative, so a
stop lands inside multi-token steps), through the app and the `openai` client. The reference is the same runner
driven directly (add + step, one sequence, no engine), before the app takes it over; with `min_tokens` the direct
run masks the stop token from sampling until then (`SamplingParams.min_tokens`), as the engine has the runner do."""

from __future__ import annotations

import openai
import pytest
from fastapi.testclient import TestClient

from dflash_jax.types import SamplingParams
from tests.tinymodels import write_tiny_llama

pytestmark = pytest.mark.slow

PROMPTS = ([40, 72, 101, 108, 108, 111, 44], [80, 33, 90, 91, 92, 93])
N_TOKENS = 32
SEED = 11


def _direct(runner, prompt: list[int], n: int, sp: SamplingParams) -> list[int]:
    toks = list(runner.add(0, prompt, sp).tokens)
    while len(toks) < n:
        toks += runner.step([0], {0: n - len(toks)})[0].tokens
    runner.release(0)
    return toks[:n]


@pytest.fixture(scope="module")
def real(tmp_path_factory):
    from dflash_jax.builder import build_runner, load_models
    from dflash_jax.server.app import create_app
    from dflash_jax.server.config import ServeConfig

    model_dir = write_tiny_llama(tmp_path_factory.mktemp("tiny") / "llama", layers=2)
    models = load_models(str(model_dir), "random:1", quant="declared")
    runner = build_runner(models, max_slots=2, max_model_len=48, gamma=4)
    assert runner.speculative
    greedy = [_direct(runner, p, N_TOKENS, SamplingParams()) for p in PROMPTS]
    masked = {}
    for i, (p, want) in enumerate(zip(PROMPTS, greedy, strict=True)):
        stop_id = _stop_id(want)
        for m in _min_tokens(want, stop_id)[1:]:
            masked[i, m] = _direct(runner, p, N_TOKENS, SamplingParams(min_tokens=m, stop_token_ids=(stop_id,)))
    ref = {
        "greedy": greedy,
        "masked": masked,
        "sampled": [_direct(runner, PROMPTS[0], 16, SamplingParams(temperature=1.0, seed=SEED + i)) for i in range(3)],
    }
    app = create_app(runner, models.target.tokenizer, ServeConfig(max_num_seqs=2), model_name="tiny")
    with TestClient(app) as client:
        oai = openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=client, max_retries=0)
        yield oai, ref


def _stop_id(want: list[int]) -> int:
    """The most frequent token, so that min_tokens has later occurrences to stop on."""
    return max(set(want[1:]), key=want.count)


def _min_tokens(want: list[int], stop_id: int) -> tuple[int, ...]:
    return (0, want.index(stop_id) + 2, N_TOKENS)


def _stop_at(ref: list[int], stop_id: int, min_tokens: int) -> list[int]:
    """The reference cut as the engine must cut it: at the first stop_id at 1-based count >= min_tokens."""
    for i, t in enumerate(ref):
        if t == stop_id and i + 1 >= min_tokens:
            return ref[: i + 1]
    return ref


def test_stop_token_ids_and_min_tokens_on_a_real_runner(real):
    oai, ref = real
    for i, (prompt, want) in enumerate(zip(PROMPTS, ref["greedy"], strict=True)):
        stop_id = _stop_id(want)
        for min_tokens in _min_tokens(want, stop_id):
            full = ref["masked"][i, min_tokens] if min_tokens else want
            assert stop_id not in full[:min_tokens]
            r = oai.completions.create(
                model="tiny",
                prompt=prompt,
                max_tokens=N_TOKENS,
                temperature=0,
                extra_body={
                    "stop_token_ids": [stop_id],
                    "min_tokens": min_tokens,
                    "ignore_eos": True,
                    "return_token_ids": True,
                },
            )
            c = r.choices[0]
            cut = _stop_at(full, stop_id, min_tokens)
            assert c.model_extra["token_ids"] == cut, (min_tokens, stop_id)
            assert len(cut) >= min_tokens
            assert c.finish_reason == ("stop" if cut[-1] == stop_id and len(cut) >= max(min_tokens, 1) else "length")


def test_n_sampled_choices_on_a_real_runner_are_seed_plus_index(real):
    oai, ref = real
    r = oai.completions.create(
        model="tiny",
        prompt=PROMPTS[0],
        n=3,
        seed=SEED,
        temperature=1.0,
        max_tokens=16,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    got = [c.model_extra["token_ids"] for c in r.choices]
    assert got == ref["sampled"]
    assert len({tuple(g) for g in got}) >= 2  # seeds + i are different streams
    # greedy choices of a prompt list, batched together, equal the one-sequence reference
    g = oai.completions.create(
        model="tiny",
        prompt=list(PROMPTS),
        temperature=0,
        max_tokens=N_TOKENS,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    assert [c.model_extra["token_ids"] for c in g.choices] == ref["greedy"]
