"""Log-probabilities in OpenAI's response shapes.

Chat: `choices[i].logprobs = {"content": [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}]}`, one
entry per generated token, `top_logprobs` the N most likely tokens. Completions: `choices[i].logprobs = {tokens,
token_logprobs, top_logprobs, text_offset}`, one entry per token (with `echo`, the prompt's tokens first; the first
prompt token has `null` log-probability and alternatives); each `top_logprobs` dict holds the N most likely tokens
and the chosen one (so up to N + 1 entries, as vLLM and OpenAI's legacy API answer). A token's text is its raw bytes
decoded as UTF-8 (a partial character shows as U+FFFD); `text_offset` counts the characters that begin before the
token in the choice's text. Streamed chunks carry the entries of their own tokens; offsets continue across chunks.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from dflash_jax.engine.types import TokenizerLike
from dflash_jax.types import TokenLogprob

MIN_LOGPROB = -9999.0  # -inf (a token the model rules out) as a JSON number, as vLLM writes it


class TokenTexts:
    """Token ids -> (text, raw bytes), cached; uses the tokenizer's `token_bytes` when it has one."""

    def __init__(self, tokenizer: TokenizerLike):
        self._tok = tokenizer
        self._token_bytes = getattr(tokenizer, "token_bytes", None)
        self._cache: dict[int, tuple[str, bytes]] = {}

    def __call__(self, token_id: int) -> tuple[str, bytes]:
        hit = self._cache.get(token_id)
        if hit is None:
            if self._token_bytes is not None:
                raw = self._token_bytes(token_id)
            else:
                raw = self._tok.decode([token_id]).encode()
            hit = self._cache[token_id] = (raw.decode("utf-8", errors="replace"), raw)
        return hit


def _lp(x: float) -> float:
    return max(float(x), MIN_LOGPROB)


def _char_starts(raw: bytes) -> int:
    return sum(1 for b in raw if b & 0xC0 != 0x80)


class ChoiceLogprobs:
    """One choice's log-probabilities, rendered event by event (`chat` or completions; `top`: alternatives per
    token). Completions keep a running text offset, starting at `offset` (the echoed prompt's characters)."""

    def __init__(self, tokenizer: TokenizerLike | TokenTexts, *, chat: bool, top: int, offset: int = 0):
        self.texts = tokenizer if isinstance(tokenizer, TokenTexts) else TokenTexts(tokenizer)
        self.chat = chat
        self.top = top
        self.offset = offset

    def tokens(self, ids: Sequence[int], entries: Sequence[TokenLogprob | None]) -> dict[str, Any]:
        """The logprobs object for `ids` (entry None: no log-probability, the first prompt token)."""
        if len(ids) != len(entries):
            raise ValueError(f"{len(ids)} tokens but {len(entries)} log-probabilities")
        if self.chat:
            return {"content": [self._chat_entry(t, e) for t, e in zip(ids, entries, strict=True) if e is not None]}
        out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for t, e in zip(ids, entries, strict=True):
            text, raw = self.texts(t)
            out["tokens"].append(text)
            out["text_offset"].append(self.offset)
            self.offset += _char_starts(raw)
            if e is None:
                out["token_logprobs"].append(None)
                out["top_logprobs"].append(None)
                continue
            out["token_logprobs"].append(_lp(e.logprob))
            alts: dict[str, float] = {}
            for alt, lp in e.top[: self.top]:
                alts.setdefault(self.texts(alt)[0], _lp(lp))
            alts.setdefault(text, _lp(e.logprob))
            out["top_logprobs"].append(alts)
        return out

    def prompt(self, ids: Sequence[int], entries: Sequence[TokenLogprob]) -> dict[str, Any]:
        """Completions with `echo`: the prompt's tokens (the first has no log-probability)."""
        return self.tokens(ids, [None, *entries][: len(ids)])

    def _chat_entry(self, token_id: int, e: TokenLogprob) -> dict[str, Any]:
        text, raw = self.texts(token_id)
        return {
            "token": text,
            "logprob": _lp(e.logprob),
            "bytes": list(raw),
            "top_logprobs": [
                {"token": self.texts(alt)[0], "logprob": _lp(lp), "bytes": list(self.texts(alt)[1])}
                for alt, lp in e.top[: self.top]
            ],
        }


def join(parts: Sequence[dict[str, Any] | None]) -> dict[str, Any] | None:
    """Concatenate logprobs objects of one choice (the prompt's, then the completion's)."""
    parts = [p for p in parts if p is not None]
    if not parts:
        return None
    return {k: [x for p in parts for x in p[k]] for k in parts[0]}
