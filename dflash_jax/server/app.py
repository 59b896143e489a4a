"""The OpenAI-compatible HTTP API (FastAPI) over the engine.

`create_app(runner, tokenizer, config)` builds the app; `dflash_jax.server.launch.run_server` serves it with
uvicorn (SIGTERM drain included). Every error is an OpenAI error object; bad input is always a 4xx.

Endpoints: POST /v1/completions, POST /v1/chat/completions (SSE with `stream`), GET /v1/models,
GET /health, GET /metrics, POST /tokenize, POST /detokenize.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.responses import JSONResponse, Response, StreamingResponse

from dflash_jax.engine.engine import Engine, RequestStream
from dflash_jax.engine.interface import StepRunner
from dflash_jax.engine.types import (
    FINISH_ABORT,
    ContextLengthError,
    DraftController,
    EngineUnavailableError,
    GenerationRequest,
    QueueFullError,
    RequestOutput,
    TokenizerLike,
)
from dflash_jax.server import protocol as P
from dflash_jax.server.config import ServeConfig
from dflash_jax.server.errors import APIError, bad_request, error_body, from_validation_error
from dflash_jax.server.metrics import ServerMetrics

log = logging.getLogger("dflash_jax.server")

_RETRY_AFTER = {"starting": "5", "draining": "5", "queue": "1"}


def _reject_constant(name: str) -> Any:
    raise ValueError(f"invalid JSON constant {name}")


class _Server:
    """Request handling state shared by the routes."""

    def __init__(
        self,
        engine: Engine,
        tokenizer: TokenizerLike,
        config: ServeConfig,
        model_name: str,
        metrics: ServerMetrics,
    ):
        self.engine = engine
        self.tok = tokenizer
        self.config = config
        self.model_name = model_name
        self.model_names = {model_name, config.model}
        self.metrics = metrics
        self.vocab_size: int | None = getattr(tokenizer, "vocab_size", None)
        self.created = int(time.time())
        self._api_key = config.api_key.encode() if config.api_key else None

    # -- request plumbing ---------------------------------------------------------------------------

    def check_auth(self, request: Request) -> None:
        if self._api_key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), self._api_key):
            raise APIError(
                401,
                "Incorrect or missing API key. Send it as 'Authorization: Bearer <key>'.",
                type="invalid_request_error",
                code="invalid_api_key",
            )

    async def read_json(self, request: Request) -> dict[str, Any]:
        limit = self.config.max_request_bytes
        too_big = APIError(413, f"Request body too large: the limit is {limit} bytes.", code="request_too_large")
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            raise too_big
        chunks, size = [], 0
        try:
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise too_big
                chunks.append(chunk)
        except ClientDisconnect:
            raise bad_request("The client disconnected while sending the request body.") from None
        body = b"".join(chunks)
        try:
            obj = json.loads(body, parse_constant=_reject_constant)
        except (ValueError, UnicodeDecodeError, RecursionError) as e:
            raise bad_request(
                f"We could not parse the JSON body of your request ({type(e).__name__}: {str(e)[:200]}). "
                "The body must be a JSON object."
            ) from None
        if not isinstance(obj, dict):
            raise bad_request(f"The request body must be a JSON object, got {type(obj).__name__}.")
        return obj

    @staticmethod
    def parse(model: type[BaseModel], obj: dict[str, Any]) -> Any:
        try:
            return model.model_validate(obj)
        except ValidationError as e:
            raise from_validation_error(e) from None

    def check_model(self, model: str | None) -> None:
        if model is not None and model not in self.model_names:
            raise APIError(
                404,
                f"The model `{model}` does not exist. This server serves `{self.model_name}`.",
                param="model",
                code="model_not_found",
            )

    async def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        if len(text) > 20_000:
            return await run_in_threadpool(self.tok.encode, text, add_special_tokens)
        return self.tok.encode(text, add_special_tokens)

    def render_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> str:
        try:
            return self.tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
        except Exception as e:  # a template that refuses these messages is a problem with the request
            raise bad_request(f"The chat template rejected the messages: {e}", "messages") from None

    def submit(self, gen: GenerationRequest) -> RequestStream:
        try:
            return self.engine.submit(gen)
        except QueueFullError as e:
            self.metrics.rejected.labels(reason="queue_full").inc()
            raise APIError(
                429, str(e), code="server_overloaded", headers={"Retry-After": _RETRY_AFTER["queue"]}
            ) from None
        except EngineUnavailableError as e:
            self.metrics.rejected.labels(reason=e.reason).inc()
            raise unavailable(e) from None
        except ContextLengthError as e:
            raise bad_request(str(e), e.param, "context_length_exceeded") from None

    def check_length(self, n_prompt: int, max_tokens: int | None, where: str) -> int:
        try:
            return self.engine.check_length(n_prompt, max_tokens, where=where)
        except ContextLengthError as e:
            raise bad_request(str(e), e.param, "context_length_exceeded") from None

    def check_ready(self) -> None:
        if not self.engine.ready:
            e = self.engine.unavailable_error()
            self.metrics.rejected.labels(reason=e.reason).inc()
            raise unavailable(e)

    # -- generation ---------------------------------------------------------------------------------

    async def generate(self, request: Request, chat: bool) -> Response:
        self.check_auth(request)
        obj = await self.read_json(request)
        req = self.parse(P.ChatCompletionRequest if chat else P.CompletionRequest, obj)
        self.check_model(req.model)
        P.check_common(req)
        sampling = P.sampling_of(req, self.vocab_size)
        stop = P.stop_of(req)
        max_tokens = P.max_tokens_of(req)
        if chat:
            text = self.render_chat(P.messages_of(req.messages))
            ids = await self.encode(text, False)
            where = "messages"
        else:
            prompt = P.prompt_of(req)
            if isinstance(prompt, str):
                ids = await self.encode(prompt, True)
            else:
                P.check_token_ids(prompt, self.vocab_size, "prompt")
                ids = list(prompt)
            where = "prompt"
        if not ids:
            raise bad_request(f"The {where} is empty after tokenization.", where)
        self.check_ready()
        limit = self.check_length(len(ids), max_tokens, where)
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        gen = GenerationRequest(
            prompt_ids=ids,
            max_tokens=limit,
            sampling=sampling,
            stop=stop,
            ignore_eos=req.ignore_eos,
            request_id=rid,
        )
        stream = self.submit(gen)
        created = int(time.time())
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return StreamingResponse(
                self._sse(
                    stream, chat=chat, created=created, include_usage=include_usage, token_ids=req.return_token_ids
                ),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            )
        out = await self._collect(request, stream)
        if out is None:  # client went away; nothing to answer
            return Response(status_code=499)
        if out.error is not None:
            raise APIError(500, out.error, type="internal_server_error", code="engine_error")
        if out.finish_reason == FINISH_ABORT:
            raise APIError(
                503,
                "The request was cancelled because the server is shutting down.",
                code="server_shutting_down",
            )
        choice: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": out.finish_reason}
        if chat:
            choice["message"] = {"role": "assistant", "content": out.text}
        else:
            choice["text"] = out.text
        if req.return_token_ids:
            choice["prompt_token_ids"] = list(ids)
            choice["token_ids"] = list(out.token_ids)
        body = {
            "id": rid,
            "object": "chat.completion" if chat else "text_completion",
            "created": created,
            "model": self.model_name,
            "choices": [choice],
            "usage": usage(out),
            "metrics": spec_metrics(out),
        }
        return JSONResponse(body)

    async def _collect(self, request: Request, stream: RequestStream) -> RequestOutput | None:
        """Wait for the result while watching for a client disconnect (which aborts the request)."""
        result = asyncio.ensure_future(stream.collect())
        gone = asyncio.ensure_future(_wait_disconnect(request))
        try:
            done, _ = await asyncio.wait({result, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not result.done():
                stream.abort()
            gone.cancel()
        if result in done:
            return result.result()
        result.cancel()
        return None

    async def _sse(
        self, stream: RequestStream, *, chat: bool, created: int, include_usage: bool, token_ids: bool = False
    ) -> AsyncIterator[bytes]:
        rid = stream.request_id
        obj = "chat.completion.chunk" if chat else "text_completion"

        def chunk(
            text: str,
            finish_reason: str | None = None,
            *,
            role: bool = False,
            metrics: dict[str, Any] | None = None,
            ids: list[int] | None = None,
        ) -> bytes:
            if chat:
                if role:
                    delta: dict[str, Any] = {"role": "assistant", "content": ""}
                else:
                    delta = {"content": text} if text or finish_reason is None else {}
                choice: dict[str, Any] = {
                    "index": 0,
                    "delta": delta,
                    "logprobs": None,
                    "finish_reason": finish_reason,
                }
            else:
                choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
            if token_ids and not role:
                choice["token_ids"] = list(ids or [])
            body: dict[str, Any] = {
                "id": rid,
                "object": obj,
                "created": created,
                "model": self.model_name,
                "choices": [choice],
            }
            if include_usage:
                body["usage"] = None
            if metrics is not None:
                body["metrics"] = metrics
            return _sse_line(body)

        last: RequestOutput | None = None
        try:
            if chat:
                yield chunk("", role=True)
            async for out in stream:
                last = out
                if out.error is not None:
                    yield APIError(500, out.error, type="internal_server_error", code="engine_error").sse()
                    break
                if out.finished and out.finish_reason == FINISH_ABORT:
                    yield APIError(
                        503,
                        "The request was cancelled because the server is shutting down.",
                        code="server_shutting_down",
                    ).sse()
                    break
                if out.finished:
                    yield chunk(out.text, out.finish_reason, metrics=spec_metrics(out), ids=out.token_ids)
                elif out.text or (token_ids and out.token_ids):
                    yield chunk(out.text, ids=out.token_ids)
            if include_usage and last is not None and last.error is None:
                yield _sse_line(
                    {
                        "id": rid,
                        "object": obj,
                        "created": created,
                        "model": self.model_name,
                        "choices": [],
                        "usage": usage(last),
                    }
                )
            yield b"data: [DONE]\n\n"
        finally:
            stream.abort()  # no-op when finished; frees the slot when the client went away


def _sse_line(body: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


async def _wait_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return
        await asyncio.sleep(0.05)  # a stray body message: don't spin


def usage(out: RequestOutput) -> dict[str, int]:
    return {
        "prompt_tokens": out.num_prompt_tokens,
        "completion_tokens": out.num_completion_tokens,
        "total_tokens": out.num_prompt_tokens + out.num_completion_tokens,
    }


def spec_metrics(out: RequestOutput) -> dict[str, Any]:
    return {"speculative_decoding": out.spec.to_dict() if out.spec is not None else None}


def unavailable(e: EngineUnavailableError) -> APIError:
    headers = {"Retry-After": _RETRY_AFTER[e.reason]} if e.reason in _RETRY_AFTER else {}
    return APIError(503, str(e), code=f"server_{e.reason}", headers=headers)


def create_app(
    runner: StepRunner,
    tokenizer: TokenizerLike,
    config: ServeConfig,
    *,
    model_name: str | None = None,
    controller: DraftController | None = None,
    warmup: Callable[[], object] | None = None,
    log_interval_s: float = 10.0,
) -> FastAPI:
    """Build the FastAPI app. The engine starts (after `warmup`, run on the device thread) when the app does;
    /health is 503 until then. `app.state.engine` and `app.state.metrics` give access for launchers/tests."""
    model_name = model_name or config.model_name
    metrics = ServerMetrics(model_name, bool(getattr(runner, "speculative", False)))
    engine = Engine(
        runner,
        tokenizer,
        max_num_seqs=config.max_num_seqs,
        max_queued_requests=config.max_queued_requests,
        controller=controller,
        observer=metrics,
        log_interval_s=log_interval_s,
    )
    metrics.bind(engine)
    srv = _Server(engine, tokenizer, config, model_name, metrics)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        starting = asyncio.create_task(engine.start(warmup))
        try:
            yield
        finally:
            if not starting.done():
                starting.cancel()
            await engine.stop()

    app = FastAPI(title="dflash-jax", version="0.1.0", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.engine = engine
    app.state.metrics = metrics
    app.state.config = config

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        msg = {
            404: f"Unknown endpoint {request.method} {request.url.path}.",
            405: f"Method {request.method} is not allowed on {request.url.path}.",
        }.get(exc.status_code, str(exc.detail))
        return APIError(exc.status_code, msg).response()

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        return bad_request(f"Invalid request: {exc.errors()[:1]}").response()

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error on %s", request.url.path)
        return JSONResponse(error_body("Internal server error.", "internal_server_error"), status_code=500)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await srv.generate(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await srv.generate(request, chat=True)

    @app.get("/v1/models")
    async def models(request: Request) -> dict[str, Any]:
        srv.check_auth(request)
        return {
            "object": "list",
            "data": [
                {
                    "id": model_name,
                    "object": "model",
                    "created": srv.created,
                    "owned_by": "dflash-jax",
                    "root": config.model,
                    "max_model_len": engine.max_model_len,
                }
            ],
        }

    @app.get("/health")
    async def health() -> Response:
        if engine.ready:
            return JSONResponse({"status": "ok"})
        return unavailable(engine.unavailable_error()).response()

    @app.get("/metrics")
    async def prom() -> Response:
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.post("/tokenize")
    async def tokenize(request: Request) -> dict[str, Any]:
        srv.check_auth(request)
        req = srv.parse(P.TokenizeRequest, await srv.read_json(request))
        srv.check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise bad_request("Give exactly one of 'prompt' or 'messages'.", "prompt")
        if req.messages is not None:
            text = srv.render_chat(P.messages_of(req.messages), req.add_generation_prompt)
            ids = await srv.encode(text, False)
        else:
            ids = await srv.encode(req.prompt or "", req.add_special_tokens)
        return {"count": len(ids), "max_model_len": engine.max_model_len, "tokens": ids}

    @app.post("/detokenize")
    async def detokenize(request: Request) -> dict[str, Any]:
        srv.check_auth(request)
        req = srv.parse(P.DetokenizeRequest, await srv.read_json(request))
        srv.check_model(req.model)
        P.check_token_ids(req.tokens, srv.vocab_size, "tokens")
        return {"prompt": tokenizer.decode(req.tokens)}

    return app
