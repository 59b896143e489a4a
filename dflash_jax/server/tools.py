"""Tool calls: the grammar of a forced call, parsing the model's calls into OpenAI `tool_calls`, and their deltas.

The chat template renders the tools (it gets `tools=`, in its own tool format). What comes back depends on
`tool_choice`:
  * `auto` (the default with tools): the output is free; calls are parsed from it afterwards, in the Hermes / Qwen
    format (`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, any number, text before them is the
    message's content) or the Llama 3.x JSON format (the whole output is `{"name": ..., "parameters": {...}}`,
    optionally after `<|python_tag|>`, several separated by `;`). Calls of functions not in `tools` are not calls.
  * a named function: the output is that function's arguments, a JSON object following its `parameters` schema
    (enforced by the grammar): one call.
  * `required`: the output is a JSON array of `{"name", "parameters"}` objects, each following its tool's schema
    (one item at most with `parallel_tool_calls: false`): at least one call.
  * `none`: no calls (the tools are still rendered).
A choice with calls finishes with `tool_calls` (or `length` when `max_tokens` cut it: its text is then the content).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

HERMES_START, HERMES_END = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)


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


def forced_schema(tools: list[Any], choice: Any, parallel: bool | None) -> dict[str, Any] | None:
    """The JSON schema the output follows for `tool_choice` (None for auto / none): the named function's
    parameters, or for `required` an array of calls. Raises KeyError(name) for a named function not in `tools`."""
    if choice is None or choice in ("auto", "none"):
        return None
    by_name = {t.function.name: t for t in tools}
    if choice == "required":
        items = [
            {
                "type": "object",
                "properties": {"name": {"const": name}, "parameters": _params(t)},
                "required": ["name", "parameters"],
                "additionalProperties": False,
            }
            for name, t in by_name.items()
        ]
        schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
        if parallel is False:
            schema["maxItems"] = 1
        return schema
    return _params(by_name[choice.function.name])


def _call_of(obj: Any, names: set[str]) -> Call | None:
    if not isinstance(obj, dict) or obj.get("name") not in names:
        return None
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


def parse_tool_calls(text: str, names: set[str]) -> tuple[str | None, list[Call]]:
    """(content, calls) of an output under `tool_choice: auto` (module docstring); no calls: (text, [])."""
    if HERMES_START in text:
        calls = []
        for body in _HERMES.findall(text):
            try:
                call = _call_of(json.loads(body), names)
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
        calls = [_call_of(o, names) for o in objs or []]
        if objs and all(calls):
            return None, calls  # type: ignore[return-value]
    return text, []


def forced_calls(text: str, choice: Any) -> list[Call] | None:
    """The calls of a named / required choice's output (None when it is not complete JSON)."""
    try:
        value = json.loads(text)
    except ValueError:
        return None
    if choice == "required":
        if not isinstance(value, list):
            return None
        return [Call(v["name"], json.dumps(v["parameters"], ensure_ascii=False)) for v in value]
    return [Call(choice.function.name, json.dumps(value, ensure_ascii=False))]


def _held_back(text: str) -> int:
    """How many trailing characters of `text` may be the start of a `<tool_call>` tag."""
    for n in range(min(len(HERMES_START) - 1, len(text)), 0, -1):
        if HERMES_START.startswith(text[-n:]):
            return n
    return 0


class ChoiceTools:
    """One chat choice's tool handling: streamed deltas as text comes, and the final message."""

    def __init__(self, tools: list[Any], choice: Any):
        self.names = {t.function.name for t in tools}
        self.choice = "auto" if choice is None else choice
        self.text = ""
        self.sent = 0  # characters of `text` emitted as content
        self.buffering = False
        self.started = False  # named: the call's first delta (id, name) went out

    @property
    def named(self) -> bool:
        return not isinstance(self.choice, str)

    def message(self, text: str, finish_reason: str | None) -> tuple[dict[str, Any], str | None]:
        """The non-streamed message and finish reason."""
        if self.choice == "none":
            return {"role": "assistant", "content": text}, finish_reason
        if self.choice == "auto":
            content, calls = parse_tool_calls(text, self.names)
        else:
            calls = forced_calls(text, self.choice) if finish_reason == "stop" else None
            content = None if calls else text
        if not calls:
            return {"role": "assistant", "content": text}, finish_reason
        return {"role": "assistant", "content": content, "tool_calls": [c.openai() for c in calls]}, "tool_calls"

    def delta(self, new: str) -> list[dict[str, Any]]:
        """The deltas to send for newly generated text."""
        self.text += new
        if self.choice == "none":
            return [{"content": new}] if new else []
        if self.named:
            out = []
            if not self.started:
                self.started = True
                call = Call(self.choice.function.name, "").openai(0)
                out.append({"tool_calls": [call]})
            if new:
                out.append({"tool_calls": [{"index": 0, "function": {"arguments": new}}]})
            return out
        if self.choice == "required" or self.buffering:
            return []
        i = self.text.find(HERMES_START)
        head = self.text.lstrip()
        if i >= 0:
            self.buffering = True
            end = i
        elif self.sent == 0 and (not head or head.startswith(("{", PYTHON_TAG)) or PYTHON_TAG.startswith(head)):
            self.buffering = head.startswith(("{", PYTHON_TAG))  # a Llama JSON call: held until the end
            return []
        else:
            end = len(self.text) - _held_back(self.text)
        out = self.text[self.sent : end]
        self.sent = max(self.sent, end)
        return [{"content": out}] if out else []

    def finish(self, finish_reason: str | None) -> tuple[list[dict[str, Any]], str | None]:
        """The last deltas and the finish reason, once the choice ended."""
        if self.choice == "none":
            return [], finish_reason
        if self.named:
            calls = forced_calls(self.text, self.choice) if finish_reason == "stop" else None
            return [], "tool_calls" if calls else finish_reason
        if self.choice == "required":
            calls = forced_calls(self.text, self.choice) if finish_reason == "stop" else None
        else:
            _, calls = parse_tool_calls(self.text, self.names)
        if calls:
            return [{"tool_calls": [c.openai(i) for i, c in enumerate(calls)]}], "tool_calls"
        rest = self.text[self.sent :]
        self.sent = len(self.text)
        return ([{"content": rest}] if rest else []), finish_reason
