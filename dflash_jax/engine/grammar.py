"""Constrained decoding on the host: one llguidance matcher per sequence, and the packed token masks the step applies.

llguidance (`llguidance` on PyPI) compiles JSON schemas, regular expressions, choices and Lark grammars against the
tokenizer and computes, for a matcher's state, the set of tokens allowed next as a bitmask: int32 words, bit
`t % 32` of word `t // 32` set when token t is allowed. It needs no torch (its numpy helpers write masks into host
arrays), which is why it is used rather than xgrammar.

The runner (`spec_decode.runner`) asks each constrained sequence for its masks and applies them inside the jitted
step, before sampling and acceptance:
  * a plain step or a prefill: one mask, the matcher's current state;
  * a speculative step: after the drafter proposed, `spec_decode.draft_choice` re-chooses the drafts under the
    grammar as it walks them on the matcher (`advance`, then `rollback`): verify position 0 gets the current mask,
    position j the mask after drafts 1..j, and each draft is one the mask of its position allows. A position
    where no candidate of the drafter is allowed ends the draft there.
After the step the matcher consumes the emitted tokens (`consume`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import llguidance
import llguidance.numpy as llnp
import numpy as np

from dflash_jax.errors import UserError

# Compact JSON output, no whitespace between tokens (`{"a":1,"b":[true]}`, what `json.dumps(...,
# separators=(",", ":"))` writes): a model cannot wander into endless whitespace.
_JSON = {"whitespace_flexible": False}


def mask_words(vocab_size: int) -> int:
    """int32 words of a packed token mask over `vocab_size` tokens."""
    return (vocab_size + 31) // 32


def grammar_tokenizer(tokenizer_json: str, vocab_size: int, eos_ids: list[int]) -> llguidance.LLTokenizer:
    """llguidance's tokenizer over a HF `tokenizers` tokenizer (its JSON, as `tokenizers.Tokenizer.to_str()` gives
    it: what llguidance's HF integration passes it), sized to the target's vocabulary. Building it takes about a
    second for a large vocabulary: make one per tokenizer."""
    eos = sorted(eos_ids)
    return llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=eos if eos else None)


def grammar_from(kind: str, text: Any) -> str:
    """An llguidance grammar (what `SamplingParams.grammar` holds) from `kind`: json_schema (a schema, dict or JSON
    text), json_object (any JSON object), regex, choice (a list of strings), lark, or grammar (Lark or GBNF).
    Raises ValueError for text llguidance cannot read."""
    if kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, overrides=_JSON)
    if kind == "json_schema":
        schema = text if isinstance(text, str) else json.dumps(text)
        return llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=_JSON)
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(text)
    if kind == "choice":
        return llguidance.grammar_from("choice", list(text))
    if kind == "lark":
        return llguidance.LLMatcher.grammar_from_lark(text)
    if kind == "grammar":  # Lark or GBNF
        return llguidance.grammar_from("grammar", text)
    raise ValueError(f"unknown grammar kind {kind!r}")


@dataclass
class GrammarCompiler:
    """Builds the matchers of one tokenizer; `vocab_size` is the target's (the masks' width in tokens)."""

    tokenizer: llguidance.LLTokenizer
    vocab_size: int

    @classmethod
    def from_tokenizer(cls, tokenizer: Any, vocab_size: int) -> GrammarCompiler:
        """From a `checkpoints.tokenizer.TextTokenizer` (or anything with a `tokenizers.Tokenizer` as `.tk` and
        `eos_token_ids`)."""
        tk = tokenizer.tk
        return cls(grammar_tokenizer(tk.to_str(), vocab_size, list(tokenizer.eos_token_ids)), vocab_size)

    @property
    def words(self) -> int:
        return mask_words(self.vocab_size)

    def check(self, grammar: str, param: str) -> None:
        """A `UserError` naming `param` when llguidance rejects `grammar` (an invalid schema, regex or grammar)."""
        is_error, msgs = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, self.tokenizer)
        if is_error:
            raise UserError(msgs[0] if msgs else "rejected by the grammar compiler", param=param)

    def matcher(self, grammar: str) -> SlotGrammar:
        m = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0)
        if m.is_error():
            raise UserError(f"invalid grammar: {m.get_error()}", param="response_format")
        return SlotGrammar(m, self.words, mask_words(self.tokenizer.vocab_size), self.tokenizer.eos_tokens)


class SlotGrammar:
    """One sequence's matcher and its mask computations (host numpy)."""

    def __init__(self, matcher: llguidance.LLMatcher, words: int, ll_words: int, eos: list[int] = ()):
        self.m = matcher
        self.eos = frozenset(int(t) for t in eos)
        self.words = words  # the target's mask width
        self._buf = np.zeros((1, ll_words), np.int32)  # llguidance's own width (its vocabulary)
        self._end = np.zeros((words,), np.int32)  # only the end-of-sequence tokens
        for t in eos:
            if t < 32 * words:
                self._end[t // 32] |= np.int32(np.uint32(1 << (t % 32)).view(np.int32))

    def mask(self) -> np.ndarray:
        """The mask [words] of the tokens allowed next (only end-of-sequence once the matcher failed: see
        `consume`)."""
        if self.m.is_error():
            return self._end.copy()
        llnp.fill_next_token_bitmask(self.m, self._buf, 0)
        out = np.zeros((self.words,), np.int32)  # tokens past llguidance's vocabulary: never allowed
        n = min(self.words, self._buf.shape[1])
        out[:n] = self._buf[0, :n]
        return out

    def consume(self, tokens: list[int]) -> None:
        """Advance by emitted tokens. Each one its mask allowed, unless the mask left nothing to choose (a request
        whose `min_tokens` bans the end-of-sequence token the completed grammar allows): the matcher then fails and
        from there on allows only end-of-sequence."""
        for t in tokens:
            if self.m.is_stopped() or self.m.is_error():
                return  # the grammar is complete: what follows (EOS) ends the sequence
            self.m.consume_token(int(t))

    @property
    def done(self) -> bool:
        """Complete or failed: only end-of-sequence is allowed from here (`mask`)."""
        return bool(self.m.is_stopped() or self.m.is_error())

    def advance(self, token: int) -> bool:
        """Consume one draft (`spec_decode.draft_choice` walks a proposal; `rollback` undoes it): False when the
        matcher cannot go on (complete or failed)."""
        if self.done:
            return False
        return bool(self.m.consume_token(int(token)))

    def rollback(self, n: int) -> None:
        """Undo the last `n` consumed tokens."""
        if n:
            self.m.rollback(n)
