"""Per-request output processing: incremental detokenization and stop conditions.

Tokens arrive in groups (one speculative step can commit several). They are processed one at a time so that
EOS, a stop token, a stop string and `max_tokens` end the request at exactly the right token even inside a group;
tokens after that are dropped. EOS and stop tokens are kept in the token ids but not in the text; before
`min_tokens` tokens none of them ends the request (the runner masks EOS and the stop tokens from sampling until
then; a stop string found earlier is ordinary text).

Detokenization is incremental over a small window (as in vLLM/TGI): decode the window before and after the
new token and emit the difference, but only once it does not end in U+FFFD — so a multi-byte UTF-8 character
split across tokens is never emitted half-way. Stop strings are searched in the accumulated text (so one
that spans several tokens or steps is found) and, while streaming, the last `len(longest stop) - 1`
characters are held back so a client never sees the beginning of a stop string that is then cut.
"""

from __future__ import annotations

from collections.abc import Sequence

from dflash_jax.engine.types import FINISH_LENGTH, FINISH_STOP, TokenizerLike

_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas, never splitting a UTF-8 character."""

    def __init__(self, tokenizer: TokenizerLike, prompt_ids: Sequence[int] = (), context: int = 4):
        self._tok = tokenizer
        # A few prompt tokens as left context, so tokenizers that treat the start of a string specially
        # (SentencePiece's leading space) decode the first generated token as they would mid-text.
        ctx = list(prompt_ids[-context:]) if context > 0 else []
        if ctx and tokenizer.decode(ctx).endswith(_REPLACEMENT):
            ctx = []
        self._ids: list[int] = ctx
        self._prefix = 0  # window start
        self._read = len(ctx)  # ids before this are already emitted
        self._prefix_text = tokenizer.decode(ctx) if ctx else ""

    def push(self, token_id: int) -> str:
        """Add one token; return the text it completes ('' while a character is incomplete)."""
        self._ids.append(token_id)
        new_text = self._tok.decode(self._ids[self._prefix :])
        if new_text.endswith(_REPLACEMENT) or len(new_text) <= len(self._prefix_text):
            return ""
        if not new_text.startswith(self._prefix_text):
            # The window decodes differently once extended (rare normalisation effects): fall back to a
            # window that starts where the emitted text ended.
            self._prefix = self._read
            self._prefix_text = ""
            new_text = self._tok.decode(self._ids[self._prefix :])
            if new_text.endswith(_REPLACEMENT):
                return ""
        delta = new_text[len(self._prefix_text) :]
        self._prefix = self._read
        self._read = len(self._ids)
        self._prefix_text = self._tok.decode(self._ids[self._prefix : self._read])
        return delta

    def flush(self) -> str:
        """Everything not yet emitted, complete or not (at the end of a request)."""
        if self._read >= len(self._ids):
            return ""
        new_text = self._tok.decode(self._ids[self._prefix :])
        if new_text.startswith(self._prefix_text):
            delta = new_text[len(self._prefix_text) :]
        else:
            delta = self._tok.decode(self._ids[self._read :])
        self._prefix = self._read = len(self._ids)
        self._prefix_text = ""
        return delta


class OutputState:
    """Stops and text of one request. `append(tokens)` consumes one step's tokens and reports what to emit."""

    def __init__(
        self,
        tokenizer: TokenizerLike,
        prompt_ids: Sequence[int],
        *,
        limit: int,
        stop: Sequence[str] = (),
        ignore_eos: bool = False,
        eos_token_ids: set[int] | frozenset[int] = frozenset(),
        stop_token_ids: Sequence[int] = (),
        min_tokens: int = 0,
    ):
        if limit < 1:
            raise ValueError("limit must be >= 1")
        if not 0 <= min_tokens <= limit:
            raise ValueError(f"min_tokens must be in [0, limit={limit}], got {min_tokens}")
        self.limit = limit
        self.min_tokens = min_tokens
        self.stop = tuple(s for s in stop if s)
        self._max_stop = max((len(s) for s in self.stop), default=0)
        eos = frozenset() if ignore_eos else frozenset(eos_token_ids)
        self._stop_ids = eos | frozenset(int(t) for t in stop_token_ids)
        self._detok = IncrementalDetokenizer(tokenizer, prompt_ids)
        self.token_ids: list[int] = []
        self.text = ""
        self._sent = 0
        self.finish_reason: str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def remaining(self) -> int:
        return self.limit - len(self.token_ids)

    def append(self, tokens: Sequence[int]) -> tuple[str, list[int]]:
        """Consume tokens up to the first stop condition; return (text to emit now, tokens consumed)."""
        consumed: list[int] = []
        for t in tokens:
            if self.finished:
                break
            t = int(t)
            consumed.append(t)
            self.token_ids.append(t)
            may_stop = len(self.token_ids) >= self.min_tokens
            if may_stop and t in self._stop_ids:
                self._finish(FINISH_STOP)
                break
            if self._add_text(self._detok.push(t), may_stop):
                break
            if len(self.token_ids) >= self.limit:
                self._finish(FINISH_LENGTH)
        return self._take(), consumed

    def _add_text(self, piece: str, may_stop: bool = True) -> bool:
        """Append decoded text; on a stop string (searched only with `may_stop`, and only where it overlaps the
        new piece) cut the text there, finish, and return True."""
        if not piece:
            return False
        start = max(0, len(self.text) - self._max_stop + 1)
        self.text += piece
        if self.stop and may_stop:
            hits = [i for i in (self.text.find(s, start) for s in self.stop) if i >= 0]
            if hits:
                self.text = self.text[: min(hits)]
                self.finish_reason = FINISH_STOP
                return True
        return False

    def _finish(self, reason: str) -> None:
        self.finish_reason = reason
        # The held-back tail (an incomplete character) is emitted now; if it completes a stop string the text
        # is cut there and the reason becomes "stop".
        self._add_text(self._detok.flush())

    def _take(self) -> str:
        if self.finished:
            end = len(self.text)
        else:
            end = max(self._sent, len(self.text) - max(0, self._max_stop - 1))
        delta = self.text[self._sent : end]
        self._sent = end
        return delta
