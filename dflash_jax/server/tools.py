"""Tool calls: the grammar of a forced call, parsing the model's calls into OpenAI `tool_calls`, and their deltas.

The chat template renders the tools (it gets `tools=`, in its own tool format). The server parses one format, the
`--tool-call-parser` (`checkpoints.tokenizer.resolve_tool_call_parser`: auto is the chat template's):
  * hermes (Hermes 2 Pro, Qwen2.5, Qwen3): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, any number;
    text before the first tag is the message's content, text outside the tags after a call is dropped;
  * llama3 (Llama 3.1-3.3 JSON): the output is `{"name": ..., "parameters": {...}}` (or `"arguments"`), optionally
    after `<|python_tag|>`, several separated by `;`.
The calls are read in order while each is a call of a tool in `tools` (any JSON whitespace): an output whose first
call is not one (another function, broken JSON, not a call at all) is the message's content; from the first one
that is not, after a call, the text is content (after the text before the calls, hermes).
What comes back depends on `tool_choice`:
  * `auto` (the default with tools): the output is free; calls are parsed from it as above.
  * a named function: the grammar (`forced_grammar`) makes the output one call of it in the parser's format,
    its arguments following the function's `parameters` schema.
  * `required`: the grammar makes the output one or more calls in the parser's format, each of a tool in `tools`
    following its schema (one call with `parallel_tool_calls: false`).
  * `none`: no calls (the tools are still rendered).
Streamed (`ChoiceTools`), forced calls are compact JSON with the name first (`{"name":"f","arguments":{...}}`), so a
named call's arguments stream as they are generated; with `required` and `auto` each call goes out whole as soon as
it is closed (its `</tool_call>`, or its object's `}`), so that no delta is ever taken back. A choice with calls
finishes with `tool_calls`, or `length` when `max_tokens` cut it: a cut named call, a cut output with no closed
call, and an unterminated hermes tag at the cut are content, not calls.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

HERMES, LLAMA3 = "hermes", "llama3"
HERMES_START, HERMES_END = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
LLAMA3_SEPARATOR = "; "  # between a forced `required` output's calls
_ARGS_KEY = {HERMES: "arguments", LLAMA3: "parameters"}
# llguidance's JSON without free whitespace (`engine.grammar._JSON`): the forced calls' text is fixed around the
# arguments
_COMPACT = {"whitespace_flexible": False}


@dataclass(frozen=True)
class Call:
    name: str
    arguments: str  # JSON text

    def openai(self, index: int | None = None) -> dict[str, Any]:
        d: dict[str, Any] = {
            "id": f"call_{uuid.uuid4().hex[:24]}",
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }
        return d if index is None else {"index": index, **d}


def _params(tool: Any) -> dict[str, Any]:
    return tool.function.parameters if tool.function.parameters is not None else {"type": "object"}


def _check_parser(parser: str) -> None:
    if parser not in _ARGS_KEY:
        raise ValueError(f"tool-call parser must be hermes or llama3 (resolved), got {parser!r}")


def call_schema(name: str, params: dict[str, Any], parser: str) -> dict[str, Any]:
    """The JSON schema of one call of `name` in `parser`'s format (the name first, then the arguments)."""
    return {
        "type": "object",
        "properties": {"name": {"const": name}, _ARGS_KEY[parser]: params},
        "required": ["name", _ARGS_KEY[parser]],
        "additionalProperties": False,
    }


def _lark_string(text: str) -> str:
    return json.dumps(text)  # a JSON string literal is a Lark string literal


def forced_grammar(tools: list[Any], choice: Any, parallel: bool | None, parser: str) -> tuple[str, Any] | None:
    """(grammar kind, value) for `engine.grammar.grammar_from` of the output `tool_choice` forces in `parser`'s
    format (None for auto / none): one call of the named function, or for `required` one or more calls (one at most
    with `parallel_tool_calls: false`). Raises KeyError(name) for a named function not in `tools`."""
    _check_parser(parser)
    if choice is None or choice in ("auto", "none"):
        return None
    by_name = {t.function.name: t for t in tools}
    if choice == "required":
        items = [call_schema(name, _params(t), parser) for name, t in by_name.items()]
        one: dict[str, Any] = items[0] if len(items) == 1 else {"anyOf": items}
        many = parallel is not False
    else:
        name = choice.function.name
        one, many = call_schema(name, _params(by_name[name]), parser), False
    if parser == LLAMA3 and not many:
        return "json_schema", one
    body = "%json " + json.dumps({**one, "x-guidance": _COMPACT})
    if parser == HERMES:
        call = f"{_lark_string(HERMES_START + chr(10))} body {_lark_string(chr(10) + HERMES_END)}"
        start = 'call ("\\n" call)*' if many else "call"
        return "lark", f"start: {start}\ncall: {call}\nbody: {body}\n"
    return "lark", f"start: body ({_lark_string(LLAMA3_SEPARATOR)} body)*\nbody: {body}\n"


def _call_of(obj: Any, names: set[str], parser: str) -> Call | None:
    if not isinstance(obj, dict) or obj.get("name") not in names:
        return None
    # hermes calls carry "arguments", llama3 ones "parameters"; either is read (Llama templates show both)
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return Call(obj["name"], json.dumps(args, ensure_ascii=False))


def _calls_start(text: str, parser: str) -> int | None:
    """Where the calls of a whole output start (hermes: its first tag; llama3: its first `{` when the output is JSON
    after optional whitespace and `<|python_tag|>`), or None: no calls."""
    if parser == HERMES:
        i = text.find(HERMES_START)
        return None if i < 0 else i
    p = len(text) - len(text.lstrip())
    if text.startswith(PYTHON_TAG, p):
        p += len(PYTHON_TAG)
    return p if text.startswith("{", p) else None


def _hermes_body(body: str, names: set[str]) -> Call | None:
    try:
        return _call_of(json.loads(body), names, HERMES)
    except ValueError:
        return None


def _scan(
    text: str, pos: int, names: set[str], parser: str, final: bool, cut: bool = False
) -> tuple[list[Call], int, int | None]:
    """The calls of `text` from `pos` (the start of the calls, or the end of a call) in order, while each is a call
    of a tool: (calls, the end of the last one (`pos` when none), where the text that is not a call starts (None:
    no such text, or not known yet)). A call counts once it is closed (hermes: its `</tool_call>`; llama3: its
    object's `}`): what follows never changes it. With `final` (the whole output), what never closed is not a
    call, except a last hermes tag without its `</tool_call>` in an output that was not `cut` by `max_tokens`."""
    calls: list[Call] = []
    end = pos
    if parser == HERMES:
        while True:
            j = text.find(HERMES_START, end)
            if j < 0:
                return calls, end, None  # text outside the tags after a call is neither content nor a call
            k = text.find(HERMES_END, j + len(HERMES_START))
            if k < 0 and not final:
                return calls, end, None  # the body is still coming
            if k < 0 and cut:
                return calls, end, end
            call = _hermes_body(text[j + len(HERMES_START) : len(text) if k < 0 else k], names)
            if call is None:
                return calls, end, end
            calls.append(call)
            end = len(text) if k < 0 else k + len(HERMES_END)
    dec = json.JSONDecoder()
    while True:
        q = end
        while q < len(text) and (text[q].isspace() or text[q] == ";"):
            q += 1
        if q == len(text):
            return calls, end, None
        if text[q] != "{":
            return calls, end, q
        try:
            obj, r = dec.raw_decode(text, q)
        except ValueError:
            return calls, end, (q if final else None)  # may be an object still coming
        call = _call_of(obj, names, parser)
        if call is None:
            return calls, end, q
        calls.append(call)
        end = r


def _parse(text: str, names: set[str], parser: str, cut: bool = False) -> tuple[str | None, list[Call], bool]:
    """(content, calls, whether text after the calls is content) of a whole output (module docstring), `cut` by
    `max_tokens` or not."""
    _check_parser(parser)
    start = _calls_start(text, parser)
    if start is None:
        return text, [], False
    calls, _, rest = _scan(text, start, names, parser, final=True, cut=cut)
    if not calls:
        return text, [], False
    content = (text[:start] if parser == HERMES else "") + ("" if rest is None else text[rest:])
    return content.strip() or None, calls, rest is not None


def parse_tool_calls(text: str, names: set[str], parser: str) -> tuple[str | None, list[Call]]:
    """(content, calls) of an output in `parser`'s format (module docstring); no calls: (text, [])."""
    content, calls, _ = _parse(text, names, parser)
    return content, calls


def _held_back(text: str) -> int:
    """How many trailing characters of `text` may be the start of a `<tool_call>` tag."""
    for n in range(min(len(HERMES_START) - 1, len(text)), 0, -1):
        if HERMES_START.startswith(text[-n:]):
            return n
    return 0


def named_affixes(name: str, parser: str) -> tuple[str, str]:
    """The text a forced call of `name` has before and after its arguments (compact JSON, the name first)."""
    head = '{"name":' + json.dumps(name) + f',"{_ARGS_KEY[parser]}":'
    if parser == HERMES:
        return HERMES_START + "\n" + head, "}\n" + HERMES_END
    return head, "}"


class ChoiceTools:
    """One chat choice's tool handling in `parser`'s format (hermes or llama3, resolved): streamed deltas as text
    comes, and the final message. The deltas add up to the message (whitespace around the content aside: the
    message strips it):
      * a named call: its id and name first, then its arguments as they are generated (a choice cut by `max_tokens`
        has streamed part of them, its message is the text as content, finish `length`);
      * `required` and `auto`: content until the calls start (hermes: the text before the first `<tool_call>`, a
        possible tag prefix held back; llama3: none when the output starts as JSON); then each call once it is
        closed (`_scan`: hermes at its `</tool_call>`, llama3 at its object's `}`), as two deltas: its index, id
        and name with empty arguments, then its arguments. A call is not streamed while open because whether it is
        one is known only once it is closed (a cut output, a broken or unknown call, are content). A closed call of
        a tool stays a call whatever follows, so no delta is taken back: text after the calls that is not a call
        (a broken or unknown call, or one `max_tokens` cut) is content, streamed once known, and the choice
        finishes with `tool_calls`, or `length` when it was cut there. A cut output without a closed call (an
        unterminated hermes tag at the cut is not closed) is all content, finish `length`."""

    def __init__(self, tools: list[Any], choice: Any, parser: str):
        _check_parser(parser)
        self.names = {t.function.name for t in tools}
        self.choice = "auto" if choice is None else choice
        self.parser = parser
        self.text = ""
        self.sent = 0  # characters of `text` emitted (as content; named: the arguments' end)
        self.started = False  # named: the call's first delta (id, name) went out
        self.plain = False  # llama3: the output is not JSON, all content
        self.start: int | None = None  # where the calls start (None: not yet)
        self.end = 0  # the end of the last call sent
        self.n_calls = 0  # calls sent
        self.rest: int | None = None  # where the content after the calls starts, once known
        if self.named:
            self.head, self.tail = named_affixes(self.choice.function.name, parser)

    @property
    def named(self) -> bool:
        return not isinstance(self.choice, str)

    def message(self, text: str, finish_reason: str | None) -> tuple[dict[str, Any], str | None]:
        """The non-streamed message and finish reason."""
        if self.choice == "none" or (self.named and finish_reason != "stop"):
            return {"role": "assistant", "content": text}, finish_reason  # named: a forced call cut short
        content, calls, after = _parse(text, self.names, self.parser, cut=finish_reason == "length")
        if not calls:
            return {"role": "assistant", "content": text}, finish_reason
        reason = "length" if after and finish_reason == "length" else "tool_calls"
        return {"role": "assistant", "content": content, "tool_calls": [c.openai() for c in calls]}, reason

    def delta(self, new: str) -> list[dict[str, Any]]:
        """The deltas to send for newly generated text."""
        self.text += new
        if self.choice == "none":
            return [{"content": new}] if new else []
        if self.named:
            return self._named_delta()
        out = self._content_before() if self.start is None else []
        if self.start is not None:
            out += self._calls_delta(final=False)
        return out

    def _content_before(self) -> list[dict[str, Any]]:
        """Content before the calls, sent until they start (`start` set then)."""
        end = len(self.text)
        if self.parser == HERMES:
            i = self.text.find(HERMES_START)
            if i >= 0:
                self.start = self.end = end = i
            else:
                end -= _held_back(self.text)
        elif not self.plain:
            head = self.text.lstrip()
            if not head or PYTHON_TAG.startswith(head):
                return []  # maybe the start of a call
            self.start = _calls_start(self.text, self.parser)
            if self.start is not None:
                self.end = self.start
                return []
            self.plain = True
        out = self.text[self.sent : end]
        self.sent = max(self.sent, end)
        return [{"content": out}] if out else []

    def _calls_delta(self, final: bool, cut: bool = False) -> list[dict[str, Any]]:
        """The calls closed since the last delta, then the content after them once known."""
        out: list[dict[str, Any]] = []
        if self.rest is None:
            calls, self.end, rest = _scan(self.text, self.end, self.names, self.parser, final, cut)
            for call in calls:
                out.append({"tool_calls": [Call(call.name, "").openai(self.n_calls)]})
                out.append({"tool_calls": [{"index": self.n_calls, "function": {"arguments": call.arguments}}]})
                self.n_calls += 1
            if rest is not None:
                # no call: the whole output is content (what was sent as content, then the rest)
                self.rest = self.sent = rest if self.n_calls else self.sent
        if self.rest is not None:
            more = self.text[self.sent :]
            self.sent = len(self.text)
            if more:
                out.append({"content": more})
        return out

    def _named_delta(self) -> list[dict[str, Any]]:
        """A named call: its id and name first, then its arguments as they come (the text between the fixed head and
        the fixed tail of the forced call, the tail held back)."""
        out = []
        if not self.started:
            self.started = True
            out.append({"tool_calls": [Call(self.choice.function.name, "").openai(0)]})
        if len(self.text) > len(self.head):
            if not self.text.startswith(self.head):  # not the grammar's output: sent whole at the end
                return out
            end = max(len(self.text) - len(self.tail), len(self.head))
            args = self.text[max(self.sent, len(self.head)) : end]
            self.sent = max(self.sent, end)
            if args:
                out.append({"tool_calls": [{"index": 0, "function": {"arguments": args}}]})
        return out

    def finish(self, finish_reason: str | None) -> tuple[list[dict[str, Any]], str | None]:
        """The last deltas and the finish reason, once the choice ended."""
        if self.choice == "none":
            return [], finish_reason
        if self.named:
            _, calls = parse_tool_calls(self.text, self.names, self.parser)
            if finish_reason != "stop" or not calls:
                return [], finish_reason
            if not self.text.startswith(self.head) or not self.text.endswith(self.tail):
                rest = calls[0].arguments if self.sent == 0 else ""  # never partly streamed (see `_named_delta`)
            else:
                rest = self.text[max(self.sent, len(self.head)) : len(self.text) - len(self.tail)]
            self.sent = len(self.text)
            more = [{"tool_calls": [{"index": 0, "function": {"arguments": rest}}]}] if rest else []
            return more, "tool_calls"
        if self.start is None:  # never calls: the rest of the text is content
            rest = self.text[self.sent :]
            self.sent = len(self.text)
            return ([{"content": rest}] if rest else []), finish_reason
        out = self._calls_delta(final=True, cut=finish_reason == "length")
        if not self.n_calls:
            return out, finish_reason
        return out, "length" if self.rest is not None and finish_reason == "length" else "tool_calls"
