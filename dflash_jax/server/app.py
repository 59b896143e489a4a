"""The OpenAI-compatible HTTP API (FastAPI) over the engine.

`create_app(runner, tokenizer, config)` builds the app; `dflash_jax.server.launch.run_server` serves it with
uvicorn (SIGTERM drain included). Every error is an OpenAI error object; bad input is always a 4xx.

Endpoints: POST /v1/completions, POST /v1/chat/completions (SSE with `stream`), GET /v1/models,
GET /health, GET /metrics, POST /tokenize, POST /detokenize, GET /tokenizer_info. The routes take and return the
pydantic models of `dflash_jax.server.protocol`, so `/openapi.json` (and `/docs`) describe every body; with
`--api-key` the API routes depend on the bearer token (`fastapi.security.HTTPBearer`).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import random
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import replace
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from pydantic.json_schema import models_json_schema
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from dflash_jax.checkpoints.tokenizer import resolve_tool_call_parser
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
    SpecStats,
    TokenizerLike,
)
from dflash_jax.errors import UserError
from dflash_jax.server import protocol as P
from dflash_jax.server.config import ServeConfig
from dflash_jax.server.errors import APIError, bad_request, error_body, from_validation_errors
from dflash_jax.server.logprobs import ChoiceLogprobs, TokenTexts, join
from dflash_jax.server.metrics import ServerMetrics
from dflash_jax.server.structured import grammar_of
from dflash_jax.server.tools import ChoiceTools

log = logging.getLogger("dflash_jax.server")

_RETRY_AFTER = {"starting": "5", "draining": "5", "queue": "1"}


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
        self.token_texts = TokenTexts(tokenizer)
        self.created = int(time.time())
        self._api_key = config.api_key.encode() if config.api_key else None
        self._seeds = random.Random(config.seed)  # the seeds of sampled requests that give none (--seed)
        # constrained decoding (`server.structured`): the runner's matcher factory, None where it has none
        self.grammar_compiler = getattr(getattr(engine, "runner", None), "grammar_compiler", None)
        # the format of tool calls (`server.tools`): `--tool-call-parser`, auto resolved against the chat template
        # (`build_serving` hands it resolved; an app built directly resolves it here)
        template = getattr(tokenizer, "rendered_template", None) or getattr(tokenizer, "chat_template", None)
        self.tool_parser = resolve_tool_call_parser(config.tool_call_parser, template)

    # -- request plumbing ---------------------------------------------------------------------------

    def check_auth(self, credentials: HTTPAuthorizationCredentials | None) -> None:
        """401 unless the bearer token is the server's API key (no key configured: everything passes)."""
        if self._api_key is None:
            return
        token = credentials.credentials.strip().encode() if credentials is not None else b""
        if credentials is None or not hmac.compare_digest(token, self._api_key):
            raise APIError(
                401,
                "Incorrect or missing API key. Send it as 'Authorization: Bearer <key>'.",
                type="invalid_request_error",
                code="invalid_api_key",
            )

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

    def render_chat(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> str:
        kw = {"chat_template_kwargs": chat_template_kwargs} if chat_template_kwargs else {}
        try:
            return self.tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, **kw)
        except UserError as e:
            raise bad_request(f"The chat template rejected the messages: {e}", e.param or "messages") from None
        except Exception as e:  # a template that refuses these messages is a problem with the request
            raise bad_request(f"The chat template rejected the messages: {e}", "messages") from None

    def submit(self, gens: list[GenerationRequest]) -> list[RequestStream]:
        try:
            return self.engine.submit_many(gens)
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
        except UserError as e:
            raise bad_request(str(e), e.param) from None

    def check_length(self, n_prompt: int, max_tokens: int | None, where: str) -> int:
        try:
            return self.engine.check_length(n_prompt, max_tokens, where=where)
        except ContextLengthError as e:
            raise bad_request(str(e), e.param, "context_length_exceeded") from None

    def tokenizer_info(self) -> dict[str, Any]:
        tok = self.tok
        template = getattr(tok, "rendered_template", None) or getattr(tok, "chat_template", None)
        return {
            "tokenizer_class": type(tok).__name__,
            "bos_token": getattr(tok, "bos_token", None),
            "eos_token": getattr(tok, "eos_token", None),
            "pad_token": getattr(tok, "pad_token", None),
            "add_bos_token": bool(getattr(tok, "add_bos", False)),
            "model_max_length": self.engine.max_model_len,
            "chat_template": template,
        }

    def check_ready(self) -> None:
        if not self.engine.ready:
            e = self.engine.unavailable_error()
            self.metrics.rejected.labels(reason=e.reason).inc()
            raise unavailable(e)

    # -- generation ---------------------------------------------------------------------------------

    async def generate(self, request: Request, req: P.CompletionRequest | P.ChatCompletionRequest) -> Response:
        chat = isinstance(req, P.ChatCompletionRequest)
        self.check_model(req.model)
        P.check_common(req)
        sampling = P.sampling_of(req, self.vocab_size)
        top_lp, prompt_top_lp = P.logprobs_of(req)
        sampling = replace(sampling, logprobs=top_lp, prompt_logprobs=prompt_top_lp)
        grammar = await run_in_threadpool(grammar_of, req, self.grammar_compiler, self.tool_parser)
        if grammar is not None:
            sampling = replace(sampling, grammar=grammar)
        tools = req.tools if chat and req.tools is not None else None
        stop = P.stop_of(req)
        max_tokens = 0 if P.scores_prompt_only(req) else P.max_tokens_of(req)
        stop_ids = tuple(dict.fromkeys(req.stop_token_ids or ()))
        P.check_token_ids(list(stop_ids), self.vocab_size, "stop_token_ids")
        prompts: list[list[int]] = []
        texts: list[str | None] = []  # completions: each prompt as text when given as text (for `echo`)
        if chat:
            kwargs = req.chat_template_kwargs
            if tools is not None:  # the template renders them in its own tool format
                kwargs = {**(kwargs or {}), "tools": [t.model_dump(by_alias=True, exclude_none=True) for t in tools]}
            text = self.render_chat(P.messages_of(req.messages), chat_template_kwargs=kwargs)
            prompts.append(await self.encode(text, False))
            where = "messages"
        else:
            given = P.prompts_of(req)
            for i, prompt in enumerate(given):
                param = "prompt" if len(given) == 1 else f"prompt[{i}]"
                if isinstance(prompt, str):
                    ids = await self.encode(prompt, True)
                else:
                    P.check_token_ids(prompt, self.vocab_size, param)
                    ids = list(prompt)
                if not ids:
                    raise bad_request(f"The {param} is empty after tokenization.", param)
                prompts.append(ids)
                texts.append(prompt if isinstance(prompt, str) else None)
            where = "prompt"
        if not prompts[0]:
            raise bad_request(f"The {where} is empty after tokenization.", where)
        n = req.n or 1
        # At temperature 0 the n choices of a prompt are identical: one generation, copied into each of them.
        copies = n if sampling.temperature == 0 else 1
        runs = n // copies  # generations per prompt
        capacity = self.engine.max_num_seqs + self.engine.max_queued_requests
        if runs * len(prompts) > capacity:
            raise bad_request(
                f"This request asks for {n * len(prompts)} choices ({len(prompts)} prompt(s), n = {n}); the server "
                f"holds at most {capacity} sequences (--max-num-seqs + --max-queued-requests).",
                "n" if len(prompts) == 1 else "prompt",
                "too_many_choices",
            )
        self.check_ready()
        limits = [self.check_length(len(ids), max_tokens, where) for ids in prompts]
        if req.min_tokens > min(limits):
            raise bad_request(
                f"'min_tokens' ({req.min_tokens}) is more than the completion may hold ({min(limits)} tokens: "
                "max_tokens, or the context the prompt leaves).",
                "min_tokens",
                "min_tokens_exceeds_completion",
            )
        # completions with `echo`: each prompt's text comes first in its choices' text (and log-probabilities)
        echoes: list[str | None] = [
            None if chat or not req.echo else (t if t is not None else self.tok.decode(ids))
            for t, ids in zip(texts or [None] * len(prompts), prompts, strict=True)
        ]
        lp = None if top_lp is None else ChoiceLogprobs(self.token_texts, chat=chat, top=top_lp)
        # Choice i of a prompt samples with seed + i (as vLLM does); a sampled request without a seed gets one
        # from the server's generator (--seed), so its choices differ from each other and from other requests'.
        base = sampling.seed
        if base is None and sampling.temperature > 0:
            base = self._seeds.getrandbits(63)
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        gens = [
            GenerationRequest(
                prompt_ids=ids,
                max_tokens=limit,
                sampling=sampling if base is None else replace(sampling, seed=base + i),
                stop=stop,
                ignore_eos=req.ignore_eos,
                request_id=rid if n * len(prompts) == 1 else f"{rid}-{p * n + i}",
                stop_token_ids=stop_ids,
                min_tokens=req.min_tokens,
            )
            for p, (ids, limit) in enumerate(zip(prompts, limits, strict=True))
            for i in range(runs)
        ]
        streams = self.submit(gens)
        created = int(time.time())
        prompt_tokens = sum(len(ids) for ids in prompts)
        if req.stream:
            options = req.stream_options or P.StreamOptions()
            return StreamingResponse(
                self._sse(
                    rid,
                    streams,
                    chat=chat,
                    created=created,
                    include_usage=options.include_usage,
                    continuous_usage=options.continuous_usage_stats,
                    copies=copies,
                    token_ids=req.return_token_ids,
                    prompt_tokens=prompt_tokens,
                    choice_prompt_tokens=[len(prompts[j // n]) for j in range(n * len(prompts))],
                    logprobs=lp,
                    tools=None if tools is None else (lambda: ChoiceTools(tools, req.tool_choice, self.tool_parser)),
                    echoes=[
                        None if echoes[j // n] is None else (echoes[j // n], prompts[j // n])
                        for j in range(n * len(prompts))
                    ],
                ),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            )
        runs_out = await self._collect(request, streams)
        if runs_out is None:  # client went away; nothing to answer
            return Response(status_code=499)
        outs = [out for out in runs_out for _ in range(copies)]  # choice j is generation j // copies
        for out in outs:
            if out.error is not None:
                raise APIError(500, out.error, type="internal_server_error", code="engine_error")
        if any(out.finish_reason == FINISH_ABORT for out in outs):
            raise APIError(
                503,
                "The request was cancelled because the server is shutting down.",
                code="server_shutting_down",
            )
        choices = []
        for j, out in enumerate(outs):
            ids, echo = prompts[j // n], echoes[j // n]
            choice: dict[str, Any] = {"index": j, "logprobs": None, "finish_reason": out.finish_reason}
            if chat and tools is not None:
                ct = ChoiceTools(tools, req.tool_choice, self.tool_parser)
                choice["message"], choice["finish_reason"] = ct.message(out.text, out.finish_reason)
            elif chat:
                choice["message"] = {"role": "assistant", "content": out.text}
            else:
                choice["text"] = out.text if echo is None else echo + out.text
            if lp is not None:
                choice["logprobs"] = join(
                    [
                        lp.prompt(ids, out.prompt_logprobs or []) if echo is not None else None,
                        lp.tokens(out.token_ids, out.logprobs or []),
                    ]
                )
            if req.return_token_ids:
                choice["prompt_token_ids"] = list(ids)
                choice["token_ids"] = list(out.token_ids)
            choices.append(choice)
        body = {
            "id": rid,
            "object": "chat.completion" if chat else "text_completion",
            "created": created,
            "model": self.model_name,
            "choices": choices,
            "usage": usage(prompt_tokens, outs),
            "metrics": spec_metrics(runs_out),
        }
        return JSONResponse(body)

    async def _collect(self, request: Request, streams: list[RequestStream]) -> list[RequestOutput] | None:
        """Wait for every choice while watching for a client disconnect (which aborts them all)."""

        async def collect_all() -> list[RequestOutput]:
            return list(await asyncio.gather(*(s.collect() for s in streams)))

        result = asyncio.ensure_future(collect_all())  # a task: cancelling it leaves no unretrieved exception
        gone = asyncio.ensure_future(_wait_disconnect(request))
        try:
            done, _ = await asyncio.wait({result, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not result.done():
                for s in streams:
                    s.abort()
            gone.cancel()
        if result in done:
            return result.result()
        result.cancel()
        return None

    async def _sse(
        self,
        rid: str,
        streams: list[RequestStream],
        *,
        chat: bool,
        created: int,
        include_usage: bool,
        continuous_usage: bool = False,
        copies: int = 1,
        token_ids: bool = False,
        prompt_tokens: int = 0,
        choice_prompt_tokens: list[int] | None = None,
        logprobs: ChoiceLogprobs | None = None,
        echoes: list[tuple[str, list[int]] | None] | None = None,
        tools: Callable[[], ChoiceTools] | None = None,
    ) -> AsyncIterator[bytes]:
        """The events of every choice as they come (each chunk names its choice's `index`), then the usage
        (when asked for) and [DONE]. Choice j follows stream j // `copies` (identical greedy choices share one
        generation). `continuous_usage`: every chunk carries the usage of its choice so far (the prompt's tokens
        per `choice_prompt_tokens`). `logprobs`: the request's renderer (chunks carry their tokens'
        log-probabilities); `echoes[j]`: completions echo choice j's prompt (text, ids) in a first chunk (with its
        log-probabilities when asked). `tools`: a chat request with tools; each choice's `ChoiceTools` turns its
        text into content or tool-call deltas."""
        obj = "chat.completion.chunk" if chat else "text_completion"
        n_choices = len(streams) * copies
        echoes = echoes or [None] * n_choices
        choice_prompt_tokens = choice_prompt_tokens or [0] * n_choices

        def chunk(
            index: int,
            text: str,
            finish_reason: str | None = None,
            *,
            role: bool = False,
            metrics: dict[str, Any] | None = None,
            ids: list[int] | None = None,
            lp: dict[str, Any] | None = None,
            completion_tokens: int = 0,
            delta: dict[str, Any] | None = None,
        ) -> bytes:
            if chat:
                if role:
                    delta = {"role": "assistant", "content": ""}
                elif delta is None:
                    delta = {"content": text} if text or finish_reason is None else {}
                choice: dict[str, Any] = {
                    "index": index,
                    "delta": delta,
                    "logprobs": lp,
                    "finish_reason": finish_reason,
                }
            else:
                choice = {"index": index, "text": text, "logprobs": lp, "finish_reason": finish_reason}
            if token_ids and not role:
                choice["token_ids"] = list(ids or [])
            body: dict[str, Any] = {
                "id": rid,
                "object": obj,
                "created": created,
                "model": self.model_name,
                "choices": [choice],
            }
            if continuous_usage:
                body["usage"] = _usage(choice_prompt_tokens[index], completion_tokens)
            elif include_usage:
                body["usage"] = None
            if metrics is not None:
                body["metrics"] = metrics
            return _sse_line(body)

        def lp_of(out: RequestOutput) -> dict[str, Any] | None:
            if logprobs is None or not out.token_ids:
                return None
            return logprobs.tokens(out.token_ids, out.logprobs or [])

        events: asyncio.Queue[tuple[int, RequestOutput]] = asyncio.Queue()

        async def forward(index: int, stream: RequestStream) -> None:
            async for out in stream:
                for c in range(copies):
                    events.put_nowait((index * copies + c, out))

        forwarders = [asyncio.ensure_future(forward(i, s)) for i, s in enumerate(streams)]
        last: dict[int, RequestOutput] = {}
        echoed = [e is None for e in echoes]
        choice_tools = [tools() for _ in range(n_choices)] if tools is not None else None
        failed = False
        try:
            if chat:
                for i in range(n_choices):
                    yield chunk(i, "", role=True)
            finished = 0
            while finished < n_choices:
                i, out = await events.get()
                last[i] = out
                if not echoed[i] and out.error is None and out.finish_reason != FINISH_ABORT:
                    echoed[i] = True
                    text, ids = echoes[i]
                    prompt_lp = None if logprobs is None else logprobs.prompt(ids, out.prompt_logprobs or [])
                    yield chunk(i, text, lp=prompt_lp)
                if out.error is not None:
                    yield APIError(500, out.error, type="internal_server_error", code="engine_error").sse()
                    failed = True
                    break
                if out.finished and out.finish_reason == FINISH_ABORT:
                    yield APIError(
                        503,
                        "The request was cancelled because the server is shutting down.",
                        code="server_shutting_down",
                    ).sse()
                    failed = True
                    break
                done = out.num_completion_tokens
                if choice_tools is not None:  # text as content or tool-call deltas
                    ct = choice_tools[i]
                    deltas = ct.delta(out.text)
                    reason = out.finish_reason
                    if out.finished:
                        more, reason = ct.finish(out.finish_reason)
                        deltas += more
                    for k, d in enumerate(deltas):
                        last_one = out.finished and k == len(deltas) - 1
                        yield chunk(
                            i,
                            "",
                            reason if last_one else None,
                            delta=d,
                            metrics=spec_metrics([out]) if last_one else None,
                            ids=out.token_ids if k == 0 else [],
                            lp=lp_of(out) if k == 0 else None,
                            completion_tokens=done,
                        )
                    if out.finished:
                        finished += 1
                        if not deltas:
                            yield chunk(i, "", reason, delta={}, metrics=spec_metrics([out]), completion_tokens=done)
                    elif not deltas and (token_ids or logprobs is not None) and out.token_ids:
                        yield chunk(i, "", delta={}, ids=out.token_ids, lp=lp_of(out), completion_tokens=done)
                    continue
                if out.finished:
                    finished += 1
                    yield chunk(
                        i,
                        out.text,
                        out.finish_reason,
                        metrics=spec_metrics([out]),
                        ids=out.token_ids,
                        lp=lp_of(out),
                        completion_tokens=done,
                    )
                elif out.text or ((token_ids or logprobs is not None) and out.token_ids):
                    yield chunk(i, out.text, ids=out.token_ids, lp=lp_of(out), completion_tokens=done)
            if include_usage and not failed:
                yield _sse_line(
                    {
                        "id": rid,
                        "object": obj,
                        "created": created,
                        "model": self.model_name,
                        "choices": [],
                        "usage": usage(prompt_tokens, list(last.values())),
                    }
                )
            yield b"data: [DONE]\n\n"
        finally:
            for f in forwarders:
                f.cancel()
            for s in streams:
                s.abort()  # no-op when finished; frees the slot when the client went away


def _sse_line(body: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


async def _wait_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return
        await asyncio.sleep(0.05)  # a stray body message: don't spin


def usage(prompt_tokens: int, outs: list[RequestOutput]) -> dict[str, int]:
    """OpenAI's usage: each prompt counted once (however many choices it has), the tokens of every choice."""
    return _usage(prompt_tokens, sum(out.num_completion_tokens for out in outs))


def _usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def spec_metrics(outs: list[RequestOutput]) -> dict[str, Any]:
    """Speculation counters summed over the choices (null when none ran with a drafter's statistics)."""
    specs = [out.spec for out in outs if out.spec is not None]
    if not specs:
        return {"speculative_decoding": None}
    total = SpecStats()
    for sp in specs:
        total.num_drafts += sp.num_drafts
        total.num_draft_tokens += sp.num_draft_tokens
        total.num_accepted_tokens += sp.num_accepted_tokens
        per = sp.accepted_per_pos
        total.accepted_per_pos.extend([0] * max(0, len(per) - len(total.accepted_per_pos)))
        for k, c in enumerate(per):
            total.accepted_per_pos[k] += c
    return {"speculative_decoding": total.to_dict()}


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
        max_num_batched_tokens=config.max_num_batched_tokens,
        step_token_budget=config.step_token_budget or 0,  # `build_serving` resolves the platform default
        overlap=config.async_scheduling,
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

    app = FastAPI(
        title="dflash-jax",
        version="0.1.0",
        description=_API_DESCRIPTION,
        lifespan=lifespan,
    )
    app.add_middleware(_BodyLimit, max_bytes=config.max_request_bytes)
    app.state.engine = engine
    app.state.metrics = metrics
    app.state.config = config
    app.state.tool_call_parser = srv.tool_parser  # resolved: hermes or llama3

    bearer = HTTPBearer(auto_error=False, description="the server's --api-key, as 'Authorization: Bearer KEY'")

    async def require_api_key(credentials: HTTPAuthorizationCredentials | None = Depends(bearer)) -> None:
        srv.check_auth(credentials)

    # With --api-key every API route depends on the key (and /openapi.json says so); /health and /metrics never.
    auth = [Depends(require_api_key)] if config.api_key else []

    async def auth_error(request: Request) -> APIError | None:
        """For errors raised before the route's dependencies run (the body is read first): 401 comes first."""
        if config.api_key is None or request.url.path not in _AUTH_PATHS:
            return None
        try:
            srv.check_auth(await bearer(request))
        except APIError as e:
            return e
        return None

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 400 and (denied := await auth_error(request)) is not None:
            return denied.response()
        if exc.status_code == 413:
            return _too_large(config.max_request_bytes).response()
        msg = {
            404: f"Unknown endpoint {request.method} {request.url.path}.",
            405: f"Method {request.method} is not allowed on {request.url.path}.",
            400: "We could not read the body of your request. The body must be a JSON object.",
        }.get(exc.status_code, str(exc.detail))
        return APIError(exc.status_code, msg, headers=dict(exc.headers or {})).response()  # 405: its Allow

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        denied = await auth_error(request)
        if denied is not None:
            return denied.response()
        empty = exc.body is None and not await request.body()  # read already: FastAPI keeps the bytes
        return from_validation_errors(exc.errors(), exc.body, empty=empty).response()

    @app.exception_handler(ClientDisconnect)
    async def _gone(request: Request, exc: ClientDisconnect) -> JSONResponse:
        # the client left while sending its body: nothing was started, nobody reads the answer
        log.info("client disconnected before sending the whole body of %s", request.url.path)
        return bad_request("The client closed the connection before sending the whole request body.").response()

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error on %s", request.url.path)
        return JSONResponse(error_body("Internal server error.", "internal_server_error"), status_code=500)

    generation = _error_responses(400, 401, 404, 413, 429, 500, 503)

    @app.post(
        "/v1/completions",
        response_model=P.CompletionResponse,
        responses=generation,
        dependencies=auth,
        summary="Complete a prompt (OpenAI completions; server-sent events with `stream`)",
    )
    async def completions(body: P.CompletionRequest, request: Request) -> Response:
        return await srv.generate(request, body)

    @app.post(
        "/v1/chat/completions",
        response_model=P.ChatCompletionResponse,
        responses=generation,
        dependencies=auth,
        summary="Answer a conversation (OpenAI chat completions; server-sent events with `stream`)",
    )
    async def chat_completions(body: P.ChatCompletionRequest, request: Request) -> Response:
        return await srv.generate(request, body)

    @app.get(
        "/v1/models",
        response_model=P.ModelList,
        responses=_error_responses(401),
        dependencies=auth,
        summary="The served model",
    )
    async def models() -> dict[str, Any]:
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

    @app.get(
        "/health",
        response_model=P.HealthResponse,
        responses=_error_responses(503),
        summary="200 once the engine serves; 503 while it starts, drains or after a fatal error",
    )
    async def health() -> Response:
        if engine.ready:
            return JSONResponse({"status": "ok"})
        return unavailable(engine.unavailable_error()).response()

    @app.get(
        "/metrics",
        response_class=PlainTextResponse,
        responses={200: {"description": "Prometheus text exposition format", "content": {"text/plain": {}}}},
        summary="Prometheus metrics (dflash:* counters, gauges and histograms)",
    )
    async def prom() -> Response:
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.post(
        "/tokenize",
        response_model=P.TokenizeResponse,
        responses=_error_responses(400, 401, 404, 413),
        dependencies=auth,
        summary="Token ids of a prompt or of chat messages rendered by the chat template",
    )
    async def tokenize(req: P.TokenizeRequest) -> dict[str, Any]:
        srv.check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise bad_request("Give exactly one of 'prompt' or 'messages'.", "prompt")
        if req.prompt is not None and req.chat_template_kwargs is not None:
            raise bad_request("'chat_template_kwargs' goes with 'messages', not with 'prompt'.", "chat_template_kwargs")
        if req.messages is not None:
            P.check_template_kwargs(req.chat_template_kwargs)
            text = srv.render_chat(P.messages_of(req.messages), req.add_generation_prompt, req.chat_template_kwargs)
            ids = await srv.encode(text, False)
        else:
            ids = await srv.encode(req.prompt or "", req.add_special_tokens)
        return {"count": len(ids), "max_model_len": engine.max_model_len, "tokens": ids}

    @app.get(
        "/tokenizer_info",
        response_model=P.TokenizerInfo,
        responses=_error_responses(401),
        dependencies=auth,
        summary="The tokenizer's special tokens, chat template and context length (vLLM's /tokenizer_info)",
    )
    async def tokenizer_info() -> dict[str, Any]:
        return srv.tokenizer_info()

    @app.post(
        "/detokenize",
        response_model=P.DetokenizeResponse,
        responses=_error_responses(400, 401, 404, 413),
        dependencies=auth,
        summary="Text of token ids",
    )
    async def detokenize(req: P.DetokenizeRequest) -> dict[str, Any]:
        srv.check_model(req.model)
        P.check_token_ids(req.tokens, srv.vocab_size, "tokens")
        return {"prompt": tokenizer.decode(req.tokens)}

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = _openapi(app, sorted(srv.model_names), srv.vocab_size, engine.max_model_len)
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
    return app


_API_DESCRIPTION = """OpenAI-compatible completions and chat completions with DFlash speculative decoding.

Errors are OpenAI error objects (`{"error": {"message", "type", "param", "code"}}`); a request that fails
validation is a 400 naming the field in `param`. With `stream: true` the generation routes answer with
server-sent events: one `data: <chunk JSON>` line per chunk, then `data: [DONE]`; an error after the stream
started is sent as one `data: <error JSON>` event."""

_AUTH_PATHS = frozenset(
    {"/v1/completions", "/v1/chat/completions", "/v1/models", "/tokenize", "/detokenize", "/tokenizer_info"}
)

_ERROR_DESCRIPTIONS = {
    400: "Invalid request (the field is named in `error.param`). Every rule on a single field is in the request"
    " schema; what the schema cannot state is counted in tokens or across fields: `context_length_exceeded`"
    " (the prompt's tokens plus max_tokens over the context), `min_tokens_exceeds_completion` (min_tokens over"
    " max_tokens or the room the prompt leaves), `too_many_choices` (n times the prompts over the server's sequences:"
    " --max-num-seqs + --max-queued-requests), `conflicting_constraints` (more than one of response_format,"
    " structured_outputs, guided_* and a forced tool call), `tool_arguments_not_json` (an assistant tool call's"
    " arguments string that is not JSON), `constrained_decoding_unsupported` (an output constraint on a server whose"
    " tokenizer cannot drive the grammar engine); and a chat template that refuses the messages",
    401: "Missing or wrong API key",
    404: "Unknown model",
    413: "Request body larger than --max-request-bytes",
    429: "Too many requests waiting for a slot (see Retry-After)",
    500: "Engine failure",
    503: "Starting, draining or stopped (see Retry-After)",
}

_STREAM_CHUNKS = {"/v1/completions": P.CompletionChunk, "/v1/chat/completions": P.ChatCompletionChunk}


class _BodyLimit:
    """413 for a body over `max_bytes`, as an OpenAI error: at once when Content-Length says so, else as soon as
    the streamed body passes the limit. (FastAPI's own `max_body_size` answers a declared oversize body with
    plain text, which OpenAI clients cannot read.)"""

    def __init__(self, app: ASGIApp, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = Headers(scope=scope).get("content-length", "")
        if declared.isdigit() and int(declared) > self.max_bytes:
            await _too_large(self.max_bytes).response()(scope, receive, send)
            return
        size = 0

        async def limited() -> Message:
            nonlocal size
            message = await receive()
            if message["type"] == "http.request":
                size += len(message.get("body", b""))
                if size > self.max_bytes:  # FastAPI re-raises an HTTPException from reading the body
                    raise StarletteHTTPException(413)
            return message

        await self.app(scope, limited, send)


def _too_large(limit: int) -> APIError:
    return APIError(413, f"Request body too large: the limit is {limit} bytes.", code="request_too_large")


def _sse_event_schema(chunk: str) -> dict[str, Any]:
    """One server-sent event (OpenAPI 3.1: the stream's `schema` describes each event): its `data` is a JSON
    chunk, an error object after a failure, or `[DONE]` last."""
    return {
        "type": "object",
        "required": ["data"],
        "properties": {
            "data": {
                "description": f"a {chunk} as JSON; an ErrorResponse if generation fails; '[DONE]' last",
                "anyOf": [
                    {
                        "type": "string",
                        "contentMediaType": "application/json",
                        "contentSchema": {
                            "anyOf": [
                                {"$ref": f"#/components/schemas/{chunk}"},
                                {"$ref": "#/components/schemas/ErrorResponse"},
                            ]
                        },
                    },
                    {"type": "string", "const": "[DONE]"},
                ],
            },
            "event": {"type": "string", "const": "message"},
        },
    }


def _error_responses(*codes: int) -> dict[int | str, dict[str, Any]]:
    return {c: {"model": P.ErrorResponse, "description": _ERROR_DESCRIPTIONS[c]} for c in codes}


def _bound_token_ids(node: Any, vocab_size: int) -> None:
    """Every array of token ids (`items: {type: integer, minimum: 0}`) under `node` takes ids below the vocabulary."""
    if isinstance(node, list):
        for sub in node:
            _bound_token_ids(sub, vocab_size)
    elif isinstance(node, dict):
        items = node.get("items")
        if isinstance(items, dict) and items.get("type") == "integer" and items.get("minimum") == 0:
            items["maximum"] = vocab_size - 1
        for sub in node.values():
            _bound_token_ids(sub, vocab_size)


def _exact_bounds(dst: Any, src: Any) -> None:
    """Put back the integer bounds FastAPI's OpenAPI model turns into floats (int64's 2**63 - 1 reads as 2**63):
    `src` is the pydantic JSON schema of the component `dst`."""
    if isinstance(dst, dict) and isinstance(src, dict):
        for key in ("minimum", "maximum"):
            if isinstance(src.get(key), int) and isinstance(dst.get(key), float):
                dst[key] = src[key]
        for key, sub in dst.items():
            _exact_bounds(sub, src.get(key))
    elif isinstance(dst, list) and isinstance(src, list) and len(dst) == len(src):
        for a, b in zip(dst, src, strict=True):
            _exact_bounds(a, b)


def _set_maximum(prop: dict[str, Any], maximum: int) -> None:
    for branch in prop.get("anyOf", [prop]):
        if branch.get("type") == "integer":
            branch["maximum"] = maximum


def _openapi(app: FastAPI, model_names: list[str], vocab_size: int | None, max_model_len: int) -> dict[str, Any]:
    """FastAPI's schema with OpenAI-style validation errors (400, not FastAPI's 422), the streamed chunks, and
    the served model's values: its ids as the values `model` takes (another id is a 404), token ids below its
    vocabulary, completion lengths below its context."""
    schema = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    for request in ("CompletionRequest", "ChatCompletionRequest", "TokenizeRequest", "DetokenizeRequest"):
        _exact_bounds(components[request], getattr(P, request).model_json_schema())
        model = components[request]["properties"]["model"]
        for branch in model.get("anyOf", [model]):
            if branch.get("type") == "string":
                branch["enum"] = model_names
        if vocab_size:
            _bound_token_ids(components[request], vocab_size)
    for request in ("CompletionRequest", "ChatCompletionRequest"):
        props = components[request]["properties"]
        for name in ("max_tokens", "max_completion_tokens", "min_tokens"):  # a prompt holds a token at least
            if name in props:
                _set_maximum(props[name], max_model_len - 1)
    for name in ("HTTPValidationError", "ValidationError"):
        components.pop(name, None)
    for item in schema["paths"].values():
        for op in item.values():
            op["responses"].pop("422", None)
    _, defs = models_json_schema(
        [(m, "serialization") for m in _STREAM_CHUNKS.values()], ref_template="#/components/schemas/{model}"
    )
    for name, sub in defs.get("$defs", {}).items():
        components.setdefault(name, sub)
    for path, chunk in _STREAM_CHUNKS.items():
        ok = schema["paths"][path]["post"]["responses"]["200"]
        ok["description"] = "The completion; with `stream: true`, server-sent events of chunks ending in [DONE]"
        ok["content"]["text/event-stream"] = {"schema": _sse_event_schema(chunk.__name__)}
    return schema
