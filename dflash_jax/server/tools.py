"""Tool calls: the grammar of a forced call, parsing the model's calls into OpenAI `tool_calls`, and their deltas.

The chat template renders the tools (it gets `tools=`, in its own tool format). The server parses one format, the
`--tool-call-parser` (`checkpoints.tokenizer.resolve_tool_call_parser`: auto is the chat template's):
  * hermes (Hermes 2 Pro, Qwen2.5, Qwen3): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, any number;
    text before the first tag is the message's content;
  * llama3 (Llama 3.1-3.3 JSON): the whole output is `{"name": ..., "parameters": {...}}` (or `"arguments"`),
    optionally after `<|python_tag|>`, several separated by `;`.
What comes back depends on `tool_choice`:
  * `auto` (the default with tools): the output is free; calls are parsed from it afterwards. Calls of functions
    not in `tools` are not calls: the output is then the message's content.
  * a named function: the grammar (`forced_grammar`) makes the output one call of it in the parser's format,
    its arguments following the function's `parameters` schema.
  * `required`: the grammar makes the output one or more calls in the parser's format, each of a tool in `tools`
    following its schema (one call with `parallel_tool_calls: false`).
  * `none`: no calls (the tools are still rendered).
Forced calls are compact JSON with the name first (`{"name":"f","arguments":{...}}`), so a named call's arguments
stream as they are generated. A choice with calls finishes with `tool_calls` (or `length` when `max_tokens` cut it:
its text is then the content).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

HERMES, LLAMA3 = "hermes", "llama3"
HERMES_START, HERMES_END = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
LLAMA3_SEPARATOR = "; "  # between a forced `required` output's calls
_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)
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


def _json_objects(text: str) -> list[Any] | None:
    """`text` as JSON values separated by `;` or whitespace, or None when it is not only that."""
    dec, i, out = json.JSONDecoder(), 0, []
    while True:
        while i < len(text) and (text[i].isspace() or text[i] == ";"):
            i += 1
        if i == len(text):
            return out
        try:
            obj, i = dec.raw_decode(text, i)
        except ValueError:
            return None
        out.append(obj)


def parse_tool_calls(text: str, names: set[str], parser: str) -> tuple[str | None, list[Call]]:
    """(content, calls) of an output in `parser`'s format (module docstring); no calls: (text, [])."""
    _check_parser(parser)
    if parser == HERMES:
        if HERMES_START not in text:
            return text, []
        calls = []
        for body in _HERMES.findall(text):
            try:
                call = _call_of(json.loads(body), names, parser)
            except ValueError:
                call = None
            if call is None:
                return text, []
            calls.append(call)
        content = text[: text.index(HERMES_START)].strip()
        return content or None, calls
    body = text.strip()
    if body.startswith(PYTHON_TAG):
        body = body[len(PYTHON_TAG) :]
    if body.startswith("{"):
        objs = _json_objects(body)
        calls = [_call_of(o, names, parser) for o in objs or []]
        if objs and all(calls):
            return None, calls  # type: ignore[return-value]
    return text, []


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
    comes, and the final message."""

    def __init__(self, tools: list[Any], choice: Any, parser: str):
        _check_parser(parser)
        self.names = {t.function.name for t in tools}
        self.choice = "auto" if choice is None else choice
        self.parser = parser
        self.text = ""
        self.sent = 0  # characters of `text` emitted (auto: as content; named: the arguments' end)
        self.buffering = False
        self.started = False  # named: the call's first delta (id, name) went out
        if self.named:
            self.head, self.tail = named_affixes(self.choice.function.name, parser)

    @property
    def named(self) -> bool:
        return not isinstance(self.choice, str)

    def _calls(self, text: str, finish_reason: str | None) -> tuple[str | None, list[Call]]:
        content, calls = parse_tool_calls(text, self.names, self.parser)
        if self.choice != "auto" and finish_reason != "stop":
            return text, []  # a forced output cut short (length): its text is the content
        return content, calls

    def message(self, text: str, finish_reason: str | None) -> tuple[dict[str, Any], str | None]:
        """The non-streamed message and finish reason."""
        if self.choice == "none":
            return {"role": "assistant", "content": text}, finish_reason
        content, calls = self._calls(text, finish_reason)
        if not calls:
            return {"role": "assistant", "content": text}, finish_reason
        return {"role": "assistant", "content": content, "tool_calls": [c.openai() for c in calls]}, "tool_calls"

    def delta(self, new: str) -> list[dict[str, Any]]:
        """The deltas to send for newly generated text."""
        self.text += new
        if self.choice == "none":
            return [{"content": new}] if new else []
        if self.named:
            return self._named_delta()
        if self.choice == "required" or self.buffering:
            return []
        head = self.text.lstrip()
        if self.parser == HERMES:
            i = self.text.find(HERMES_START)
            if i >= 0:
                self.buffering = True
                end = i
            else:
                end = len(self.text) - _held_back(self.text)
        elif self.sent == 0 and (not head or head.startswith(("{", PYTHON_TAG)) or PYTHON_TAG.startswith(head)):
            self.buffering = head.startswith(("{", PYTHON_TAG))  # a Llama JSON call: held until the end
            return []
        else:
            end = len(self.text)
        out = self.text[self.sent : end]
        self.sent = max(self.sent, end)
        return [{"content": out}] if out else []

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
        _, calls = self._calls(self.text, finish_reason)
        if self.named:
            if not calls:
                return [], finish_reason
            if not self.text.startswith(self.head) or not self.text.endswith(self.tail):
                rest = calls[0].arguments if self.sent == 0 else ""  # never partly streamed (see `_named_delta`)
            else:
                rest = self.text[max(self.sent, len(self.head)) : len(self.text) - len(self.tail)]
            self.sent = len(self.text)
            more = [{"tool_calls": [{"index": 0, "function": {"arguments": rest}}]}] if rest else []
            return more, "tool_calls"
        if calls:
            return [{"tool_calls": [c.openai(i) for i, c in enumerate(calls)]}], "tool_calls"
        rest = self.text[self.sent :]
        self.sent = len(self.text)
        return ([{"content": rest}] if rest else []), finish_reason
