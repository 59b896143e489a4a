"""OpenAI-style errors: `{"error": {"message", "type", "param", "code"}}` with the right HTTP status."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from starlette.responses import JSONResponse

_TYPE_BY_STATUS = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    500: "internal_server_error",
    503: "service_unavailable_error",
}


class APIError(Exception):
    """An error answered to the client as an OpenAI error object."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str | None = None,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type or _TYPE_BY_STATUS.get(status, "invalid_request_error" if status < 500 else "server_error")
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)

    def sse(self) -> bytes:
        return b"data: " + json.dumps(self.body(), ensure_ascii=False).encode() + b"\n\n"


def error_body(message: str, type: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


_ABSENT = object()


def _path(err: Mapping[str, Any], body: Any) -> tuple[str | int, ...]:
    """The parts of a pydantic error location that index into the sent `body`: keys the client sent, list
    indices, and (for a `missing` error) the absent field's name. The other parts are the names pydantic gives
    union members (`str`, `list[int]`, `StreamOptions`, `function-after[...]`), which are not in the body; a field
    the client named `str` or `a[b` is a body key like any other. Where a union member's name is also a key of the
    value there, the reading whose value is the error's `input` wins."""
    loc, kind, want = err["loc"], err["type"], err.get("input", _ABSENT)

    def fits(value: Any) -> bool:
        return want is _ABSENT or value is want or (type(value) is type(want) and value == want)

    def walk(i: int, cur: Any, out: tuple[str | int, ...]) -> tuple[str | int, ...] | None:
        if i == len(loc):
            return out if fits(cur) else None
        part = loc[i]
        if isinstance(cur, dict) and isinstance(part, str) and part in cur:
            found = walk(i + 1, cur[part], (*out, part))
            if found is not None:
                return found
        elif isinstance(cur, list) and type(part) is int and 0 <= part < len(cur):
            found = walk(i + 1, cur[part], (*out, part))
            if found is not None:
                return found
        elif kind == "missing" and i == len(loc) - 1 and isinstance(cur, dict):
            return (*out, part)
        return walk(i + 1, cur, out)  # a union member's name

    found = walk(0, body, ())
    if found is None:  # no reading ends at the error's input: every part that indexes the body
        want = _ABSENT
        found = walk(0, body, ())
    return found or ()


def param_of(path: Sequence[str | int]) -> str:
    """('messages', 0, 'content') -> 'messages[0].content'."""
    out = ""
    for part in path:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += ("." if out else "") + str(part)
    return out


def _json_kind(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    return type(value).__name__


def from_validation_errors(errors: Sequence[Mapping[str, Any]], body: Any = None, *, empty: bool = False) -> APIError:
    """The most specific of FastAPI's body validation errors (locations start with 'body') as a 400 naming the
    parameter, in OpenAI's words. `body` is the parsed JSON body (FastAPI's `RequestValidationError.body`);
    `empty` says that no body bytes were sent."""
    errors = [dict(e, loc=tuple(e["loc"])[1:] if tuple(e["loc"])[:1] == ("body",) else tuple(e["loc"])) for e in errors]
    if not errors:
        return bad_request("Invalid request.")
    decode = next((e for e in errors if e["type"] == "json_invalid"), None)
    if decode is not None:
        pos = decode["loc"][0] if decode["loc"] else "?"
        why = (decode.get("ctx") or {}).get("error", decode["msg"])
        return bad_request(
            f"We could not parse the JSON body of your request ({why} at position {pos}). "
            "The body must be a JSON object."
        )
    if not isinstance(body, dict):  # the body as a whole
        if isinstance(body, (bytes, bytearray)):
            return bad_request("The request body must be JSON, sent with 'Content-Type: application/json'.")
        what = "an empty body" if empty else _json_kind(body)
        return bad_request(f"The request body must be a JSON object, got {what}.", code="invalid_type")
    paths = [_path(e, body) for e in errors]
    # Prefer an unknown-field error, then the deepest location (the branch of a union that got furthest), then a
    # broken limit over a wrong type (the union branch whose type the value has).
    i = min(
        range(len(errors)),
        key=lambda i: (
            errors[i]["type"] != "extra_forbidden",
            -len(paths[i]),
            str(errors[i]["type"]).endswith("_type"),
            i,
        ),
    )
    err, param = errors[i], param_of(paths[i]) or None
    kind = err["type"]
    if kind == "extra_forbidden":
        msg = f"Unrecognized request argument supplied: {param}"
    elif kind == "missing":
        msg = f"Missing required parameter: '{param}'."
    else:
        got = err.get("input")
        got_s = type(got).__name__ if not isinstance(got, (int, float, str, bool)) or got is None else repr(got)
        if isinstance(got, str) and len(got_s) > 60:
            got_s = got_s[:57] + "...'"
        msg = f"Invalid value for '{param}': {err['msg']} (got {got_s})."
    return bad_request(msg, param=param, code="invalid_value" if kind not in ("missing",) else "missing_required")
