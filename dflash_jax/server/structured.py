"""Structured outputs: the request fields that constrain a completion, turned into one llguidance grammar.

Fields (at most one per request; the schema states it): `response_format` `json_object` / `json_schema` (OpenAI),
`structured_outputs` (vLLM: `json`, `regex`, `choice`, `grammar`, `json_object`), vLLM's `guided_json`,
`guided_regex`, `guided_choice`, `guided_grammar`, and a chat request's `tool_choice` `required` or a named
function (`server.tools.forced_grammar`: the calls in the `--tool-call-parser` format). The grammar is compiled
against the served tokenizer here, so an invalid schema, regex or grammar is a 400 naming its field; the engine then
masks every step of the request with it (`engine.grammar`). A schema the model cannot finish within `max_tokens`
ends with `length`.
"""

from __future__ import annotations

from typing import Any

from dflash_jax.engine.grammar import GrammarCompiler, grammar_from
from dflash_jax.errors import UserError
from dflash_jax.server import protocol as P
from dflash_jax.server.errors import bad_request
from dflash_jax.server.tools import forced_grammar


def _constraints(req: P.CompletionRequest | P.ChatCompletionRequest, tool_parser: str) -> list[tuple[str, str, Any]]:
    """(field, grammar kind, text) of every constraint the request gives (forced tool calls in `tool_parser`'s
    format)."""
    out: list[tuple[str, str, Any]] = []
    rf = req.response_format
    if isinstance(rf, P.ResponseFormatJsonObject):
        out.append(("response_format", "json_object", None))
    elif isinstance(rf, P.ResponseFormatJsonSchema):
        schema = rf.json_schema.schema_
        if schema is None:
            out.append(("response_format.json_schema", "json_object", None))
        else:
            out.append(("response_format.json_schema.schema", "json_schema", schema))
    so = req.structured_outputs
    if so is not None:
        given = [
            (name, kind, value)
            for name, kind, value in (
                ("json", "json_schema", so.json_),
                ("regex", "regex", so.regex),
                ("choice", "choice", so.choice),
                ("grammar", "grammar", so.grammar),
                ("json_object", "json_object", so.json_object),
            )
            if value is not None
        ]
        if len(given) != 1:
            raise bad_request(
                "'structured_outputs' takes exactly one of json, regex, choice, grammar, json_object.",
                "structured_outputs",
            )
        name, kind, value = given[0]
        out.append((f"structured_outputs.{name}", kind, value))
    for field, kind in (
        ("guided_json", "json_schema"),
        ("guided_regex", "regex"),
        ("guided_choice", "choice"),
        ("guided_grammar", "grammar"),
    ):
        value = getattr(req, field)
        if value is not None:
            out.append((field, kind, value))
    if isinstance(req, P.ChatCompletionRequest) and req.tools is not None:
        try:
            forced = forced_grammar(req.tools, req.tool_choice, req.parallel_tool_calls, tool_parser)
        except KeyError as e:
            known = ", ".join(sorted(t.function.name for t in req.tools))
            raise bad_request(
                f"'tool_choice' names the function {e.args[0]!r}, which is not in 'tools' ({known}).", "tool_choice"
            ) from None
        if forced is not None:
            out.append(("tool_choice", *forced))
    return out


def check_tools(req: P.ChatCompletionRequest) -> None:
    if req.tool_choice is not None and req.tools is None:
        raise bad_request("'tool_choice' is only allowed when 'tools' are given.", "tool_choice")
    names = [t.function.name for t in req.tools or []]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise bad_request(f"'tools' names the function {dup[0]!r} more than once.", "tools")


def grammar_of(
    req: P.CompletionRequest | P.ChatCompletionRequest, compiler: GrammarCompiler | None, tool_parser: str
) -> str | None:
    """The request's llguidance grammar (None when its output is free); `tool_parser`: the resolved
    `--tool-call-parser` (hermes or llama3), the format of forced tool calls. 400 naming the field for two
    constraints, for one llguidance rejects, or when the served tokenizer cannot be used for constrained decoding."""
    if isinstance(req, P.ChatCompletionRequest):
        check_tools(req)
    given = _constraints(req, tool_parser)
    if not given:
        return None
    if len(given) > 1:
        raise bad_request(
            f"'{given[0][0]}' and '{given[1][0]}' both constrain the output: give one of them.",
            given[1][0],
            "conflicting_constraints",
        )
    field, kind, value = given[0]
    if compiler is None:
        raise bad_request(
            "This server's tokenizer does not support constrained decoding.", field, "constrained_decoding_unsupported"
        )
    try:
        grammar = grammar_from(kind, value)
    except (ValueError, TypeError) as e:
        raise bad_request(f"Invalid '{field}': {e}", field) from None
    try:
        compiler.check(grammar, field)
    except UserError as e:
        raise bad_request(f"Invalid '{field}': {e}", field) from None
    return grammar
