"""Data shared by the engine's `StepRunner` protocol and the runners that implement it (plain Python, no JAX)."""

from __future__ import annotations

from dataclasses import dataclass, field

# The most alternatives per token a request may ask for (`logprobs` / `top_logprobs`, as OpenAI caps them); the
# runner computes this many at once for every row of a batch that asks for any, so one compiled step serves all.
MAX_TOP_LOGPROBS = 20
# The most token ids a request's `min_tokens` can keep from being sampled (its stop token ids and EOS).
MAX_ENDING_TOKENS = 80


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling. temperature 0 = greedy.

    `logprobs`: the log-probability of every generated token plus that many most likely alternatives
    (0..`MAX_TOP_LOGPROBS`); `prompt_logprobs`: the same for the prompt's tokens. None = not computed.
    Log-probabilities are the target's raw distribution: log_softmax of its f32 logits at that position, before
    temperature, top-k and top-p (vLLM's default `raw_logprobs`), so they do not depend on the sampling settings.

    `min_tokens`: until that many tokens are generated, the ids in `stop_token_ids` (the tokens that end the
    request: EOS unless `ignore_eos`, and the request's own stop token ids) are masked from the target's
    distribution, in plain and speculative steps alike (as vLLM's min-tokens logits processor).

    `grammar`: an llguidance grammar (the JSON `llguidance.grammar_from` returns: a JSON schema, regex, choice or
    Lark grammar) the output must match: every token the target may choose, in plain and speculative steps, is
    masked to those the grammar allows next (`dflash_jax.engine.grammar`). `grammar_done`: how many of the
    prompt's last tokens are output the grammar has matched already (a sequence resumed after preemption).
    """

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    seed: int | None = None
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    min_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()
    grammar: str | None = None
    grammar_done: int = 0


@dataclass(frozen=True)
class TokenLogprob:
    """One token's log-probability under the target's raw distribution and the most likely tokens there
    (`top`: (token id, log-probability) pairs, most likely first)."""

    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass
class StepResult:
    """What one `step()` (or `add()`) committed for one slot."""

    tokens: list[int]
    num_drafts: int = 0  # drafts the target verified for this slot this step (0 = plain decode / prefill)
    num_accepted: int = 0  # how many of them it accepted (tokens = accepted + 1 bonus)
    accepted_mask: list[bool] = field(default_factory=list)  # per draft position: accepted?
    lookup: bool = False  # the drafts came from prompt lookup (`spec_decode.ngram`), not the drafter
    ragged: bool = False  # the step ran as a ragged verify (its plain rows at width 1: `kv.sizing.ragged_split`)
    # With `SamplingParams.logprobs`: one entry per token of `tokens`.
    logprobs: list[TokenLogprob] | None = None
    # `add()` with `SamplingParams.prompt_logprobs`: one entry per prompt token after the first (the first has none).
    prompt_logprobs: list[TokenLogprob] | None = None
