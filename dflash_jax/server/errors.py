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


_UNION_TAGS = {
    "str",
    "int",
    "float",
    "bool",
    "list",
    "dict",
    "none",
    "null",
    "literal",
    "StreamOptions",
    "TextPart",
    "ChatMessage",
}


def _is_tag(part: object) -> bool:
    """pydantic puts union member names (`str`, `list[int]`, `StreamOptions`) into `loc`."""
    if not isinstance(part, str):
        return False
    return part in _UNION_TAGS or "[" in part or part.startswith("function-")


def param_of(loc: tuple[Any, ...], *, last_is_field: bool = False) -> str:
    """('messages', 0, 'content') -> 'messages[0].content'. With `last_is_field` the last element is a
    (user-supplied) field name and is kept whatever it looks like."""
    out = ""
    for i, part in enumerate(loc):
        if _is_tag(part) and not (last_is_field and i == len(loc) - 1):
            continue
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += ("." if out else "") + str(part)
    return out


def from_validation_errors(errors: Sequence[Mapping[str, Any]]) -> APIError:
    """The most specific of FastAPI's body validation errors (locations start with 'body') as a 400 naming the
    parameter, in OpenAI's words."""
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
    # Prefer an unknown-field error, then the deepest location (the branch of a union that got furthest).
    errors.sort(key=lambda e: (e["type"] != "extra_forbidden", -len([p for p in e["loc"] if not _is_tag(p)])))
    err = errors[0]
    kind = err["type"]
    if not [p for p in err["loc"] if not _is_tag(p)]:  # the body as a whole
        got = err.get("input")
        if isinstance(got, (bytes, bytearray)):
            return bad_request("The request body must be JSON, sent with 'Content-Type: application/json'.")
        what = "missing" if kind == "missing" or got is None else type(got).__name__
        return bad_request(f"The request body must be a JSON object, got {what}.")
    param = param_of(err["loc"], last_is_field=kind == "extra_forbidden") or None
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
