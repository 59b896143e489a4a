"""schemathesis hooks for `test_server_clients.py` (loaded by the CLI through SCHEMATHESIS_HOOKS).

The generation routes refuse a schema-valid request only for rules counted in tokens or across fields, or for an
output constraint the served tokenizer cannot drive (the fake runner's servers), and JSON inside a string, which
JSON Schema cannot state
(the 400 response's description lists them, each with its error `code`); every other refusal of schema-valid data
fails, as schemathesis' own `positive_data_acceptance` (ST202) would.
"""

from __future__ import annotations

import schemathesis

COUNTED_IN_TOKENS = frozenset(
    {
        "context_length_exceeded",
        "min_tokens_exceeds_completion",
        "too_many_choices",
        "conflicting_constraints",
        "tool_arguments_not_json",
        "constrained_decoding_unsupported",
    }
)


@schemathesis.check
def positive_data_accepted_unless_counted_in_tokens(ctx, response, case):
    meta = case.meta
    if meta is None or not meta.generation.mode.is_positive or response.status_code < 400:
        return None
    if response.status_code in (401, 403, 404, 405, 409, 429) or response.status_code >= 500:
        return None  # the other checks judge these (not_a_server_error, status_code_conformance, ...)
    error = response.json().get("error") or {}
    if response.status_code == 400 and error.get("code") in COUNTED_IN_TOKENS:
        return None
    raise AssertionError(f"schema-valid request refused with {response.status_code}: {response.text[:500]}")
