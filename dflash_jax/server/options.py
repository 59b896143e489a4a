"""The `dflash-jax serve` flags as typer options, each also read from its `DFLASH_JAX_*` environment variable.

Precedence (click's): a flag on the command line > its environment variable (`--max-num-seqs` ->
`DFLASH_JAX_MAX_NUM_SEQS`) > the default. typer parses and type-checks the values (a bad one is a usage error
naming the flag and the variable); `build_serve_config` then receives only the settings given explicitly, so
that `--speculative-config` can tell a flag that was set from a default.

`serve_command(start)` returns the typer command; `start(config)` runs the server and returns its exit code.
`dflash-jax serve` and the fake-runner server (`python -m dflash_jax.testing.server`) are both built with it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any

import typer

from dflash_jax.checkpoints.tokenizer import TOOL_CALL_PARSERS
from dflash_jax.errors import UserError
from dflash_jax.server.config import (
    DEFAULT_COMPILATION_CACHE_DIR,
    PAGE_SIZES,
    ServeConfig,
    build_serve_config,
    env_name,
    flag_name,
    parse_bytes,
)


def _opt(name: str, help: str, panel: str, *, negatable: bool = False, **kw: Any) -> Any:
    decl = flag_name(name) + (f"/--no-{flag_name(name)[2:]}" if negatable else "")
    return typer.Option(decl, envvar=env_name(name), help=help, show_envvar=True, rich_help_panel=panel, **kw)


def _byte_count(text: str) -> int:
    """typer parser of `--kv-cache-memory` (a ValueError is a usage error naming the flag and its variable)."""
    try:
        return parse_bytes(text)
    except UserError as e:
        raise ValueError(str(e)) from None


def _tool_call_parser(text: str) -> str:
    """typer parser of `--tool-call-parser` (a ValueError is a usage error naming the flag and its variable)."""
    if text not in TOOL_CALL_PARSERS:
        raise ValueError(f"must be one of {', '.join(TOOL_CALL_PARSERS)}, got {text!r}")
    return text


_MODEL, _HTTP, _SCHED, _PAR, _SPEC, _RUN = "Models", "HTTP", "Scheduling", "Parallelism", "Speculation", "Runtime"
_KV = "KV cache"
_DEFAULT = ServeConfig()  # each flag's default is its ServeConfig field's


def config_from_context(ctx: typer.Context) -> ServeConfig:
    """The `ServeConfig` of a parsed serve command: the explicitly given flags and variables, the rest default."""
    # typer ships its own click, so the source is compared by name ("DEFAULT", "ENVIRONMENT", "COMMANDLINE")
    given = {name: v for name, v in ctx.params.items() if ctx.get_parameter_source(name).name != "DEFAULT"}
    return build_serve_config(given)


def serve_command(start: Callable[[ServeConfig], int], doc: str | None = None) -> Callable[..., None]:
    """A typer command with every serve flag; it builds the `ServeConfig` and exits with `start(config)`."""

    def serve(
        ctx: typer.Context,
        model: Annotated[
            str,
            _opt(
                "model",
                "target model: HF directory, Hub repo id, GGUF file or 'default' (SmolLM2-135M-Instruct)",
                _MODEL,
            ),
        ] = _DEFAULT.model,
        draft_model: Annotated[
            str | None,
            _opt(
                "draft_model",
                "DFlash drafter (directory, Hub repo id or 'random[:LAYERS]'); unset = the default's committed one",
                _MODEL,
            ),
        ] = _DEFAULT.draft_model,
        dtype: Annotated[
            str,
            _opt(
                "dtype",
                "weights, activations and KV caches: auto | bfloat16 | float16 | float32 (auto: bfloat16 on an "
                "accelerator, float32 on CPU; norm statistics, softmax and logits are float32 in every case)",
                _MODEL,
            ),
        ] = _DEFAULT.dtype,
        no_spec: Annotated[
            bool, _opt("no_spec", "serve without speculation (plain decoding)", _SPEC)
        ] = _DEFAULT.no_spec,
        tokenizer: Annotated[
            str | None, _opt("tokenizer", "HF tokenizer directory (default: the model's own)", _MODEL)
        ] = _DEFAULT.tokenizer,
        served_model_name: Annotated[
            str | None, _opt("served_model_name", "model id reported by /v1/models and accepted in requests", _MODEL)
        ] = _DEFAULT.served_model_name,
        host: Annotated[
            str, _opt("host", "bind address; a non-loopback address needs --api-key or --allow-remote", _HTTP)
        ] = _DEFAULT.host,
        port: Annotated[int, _opt("port", "TCP port", _HTTP)] = _DEFAULT.port,
        api_key: Annotated[
            str | None,
            _opt("api_key", "require 'Authorization: Bearer KEY' on the API (not on /health, /metrics)", _HTTP),
        ] = _DEFAULT.api_key,
        allow_remote: Annotated[
            bool, _opt("allow_remote", "allow a non-loopback bind without --api-key", _HTTP)
        ] = _DEFAULT.allow_remote,
        max_num_seqs: Annotated[
            int, _opt("max_num_seqs", "sequences decoded together (runner slots)", _SCHED)
        ] = _DEFAULT.max_num_seqs,
        max_model_len: Annotated[
            int | None,
            _opt(
                "max_model_len",
                "context length: prompt + generated tokens (default: the model's, at most 2048)",
                _SCHED,
            ),
        ] = _DEFAULT.max_model_len,
        max_queued_requests: Annotated[
            int, _opt("max_queued_requests", "requests allowed to wait for a slot; beyond that: 429", _SCHED)
        ] = _DEFAULT.max_queued_requests,
        max_num_batched_tokens: Annotated[
            int,
            _opt(
                "max_num_batched_tokens",
                "tokens prefilled together in one admission between decode steps, counted as rows x the longest "
                "prompt (the batch is padded to it; a longer prompt still goes in, alone); each admission pauses "
                "the running sequences for its prefill: lower it on a CPU, where prefill is compute-bound, to "
                "shorten those pauses, raise it on a GPU to admit more prompts per prefill",
                _SCHED,
            ),
        ] = _DEFAULT.max_num_batched_tokens,
        step_token_budget: Annotated[
            int | None,
            _opt(
                "step_token_budget",
                "prompt tokens one decode step prefills besides its decode rows while sequences decode (a mixed "
                "step: prompt chunks and decode rows in one device call), so running streams keep their pace "
                "while a long prompt prefills; 0: prompts prefill in calls of their own between steps (default: "
                "64 on CPU, 2048 on GPU)",
                _SCHED,
                min=0,
            ),
        ] = _DEFAULT.step_token_budget,
        async_scheduling: Annotated[
            bool,
            _opt(
                "async_scheduling",
                "dispatch each decode step before the previous one's tokens are read, so detokenizing, stop checks "
                "and streaming run while the device works (finished requests release their slot one step later)",
                _SCHED,
                negatable=True,
            ),
        ] = _DEFAULT.async_scheduling,
        seed: Annotated[
            int, _opt("seed", "server random seed (per-request 'seed' overrides it for that request)", _SCHED)
        ] = _DEFAULT.seed,
        tp_size: Annotated[int, _opt("tp_size", "tensor-parallel size of the target", _PAR)] = _DEFAULT.tp_size,
        draft_tp_size: Annotated[
            str, _opt("draft_tp_size", "drafter tensor-parallel size: 'auto' (= world size) or N", _PAR)
        ] = _DEFAULT.draft_tp_size,
        coordinator_address: Annotated[
            str | None,
            _opt("coordinator_address", "multi-host: host:port of process 0 for jax.distributed.initialize", _PAR),
        ] = _DEFAULT.coordinator_address,
        num_processes: Annotated[
            int | None, _opt("num_processes", "multi-host: number of processes", _PAR)
        ] = _DEFAULT.num_processes,
        process_id: Annotated[
            int | None, _opt("process_id", "multi-host: this process's rank (0 serves HTTP)", _PAR)
        ] = _DEFAULT.process_id,
        dflash_gamma: Annotated[
            int | None,
            _opt("dflash_gamma", "verify width gamma (gamma-1 drafts per step); unset = resolved", _SPEC),
        ] = _DEFAULT.dflash_gamma,
        dflash_adaptive_k: Annotated[
            str | None, _opt("dflash_adaptive_k", "adaptive draft count from a cost table 'drafts:ms,...'", _SPEC)
        ] = _DEFAULT.dflash_adaptive_k,
        dflash_objective: Annotated[
            str | None,
            _opt(
                "dflash_objective",
                "what --dflash-adaptive-k maximises in a batch: latency (the slowest speculating sequence's tokens/ms, "
                "the default) | throughput (the step's tokens/ms, the sequences decoding plainly included)",
                _SPEC,
            ),
        ] = _DEFAULT.dflash_objective,
        dflash_draft_ladder: Annotated[
            str | None,
            _opt("dflash_draft_ladder", "draft count by active sequences 'min_active:drafts,...'", _SPEC),
        ] = _DEFAULT.dflash_draft_ladder,
        draft_method: Annotated[
            str,
            _opt(
                "draft_method",
                "dflash: the drafter proposes every draft; hybrid: a sequence's prompt-lookup drafts (what followed "
                "the latest earlier occurrence of its last 4..2 tokens) where they exist, the drafter's elsewhere",
                _SPEC,
            ),
        ] = _DEFAULT.draft_method,
        draft_weight_quantization: Annotated[
            str, _opt("draft_weight_quantization", "drafter weights: declared | fp8 | fp8-aux | nvfp4", _SPEC)
        ] = _DEFAULT.draft_weight_quantization,
        kernel_backend: Annotated[
            str,
            _opt(
                "kernel_backend",
                "matmul backend for quantized drafter weights: auto (XLA on CPU, Pallas on GPU) | xla | pallas",
                _SPEC,
            ),
        ] = _DEFAULT.kernel_backend,
        attention_backend: Annotated[
            str,
            _opt(
                "attention_backend",
                "attention over the KV pages: auto (pallas on one GPU, xla elsewhere and under --tp-size > 1) | xla "
                "(gathers the pages; every platform) | pallas (the Triton kernel, reading the pages in place; "
                "interpreted off a GPU)",
                _SPEC,
            ),
        ] = _DEFAULT.attention_backend,
        dense_layout: Annotated[
            str,
            _opt(
                "dense_layout",
                "the matmul weights' layout in the steps: auto (out-in on CPU with one device, in-out elsewhere) | "
                "in-out (as loaded, x @ W) | out-in (an [out, in] copy read as W·xᵀ: XLA:CPU's fast dot for the "
                "few tokens of a decode or verify step)",
                _RUN,
            ),
        ] = _DEFAULT.dense_layout,
        deterministic: Annotated[
            bool,
            _opt(
                "deterministic",
                "greedy output bit-identical to plain decoding: every step runs the target at the full verify width,"
                " batch and context (slower)",
                _SPEC,
            ),
        ] = _DEFAULT.deterministic,
        tool_call_parser: Annotated[
            str,
            _opt(
                "tool_call_parser",
                "the format of the model's tool calls: auto (the chat template's; hermes when it shows none) | "
                'hermes (Hermes / Qwen2.5 / Qwen3 <tool_call>{"name": ..., "arguments": ...}</tool_call>) | llama3 '
                '(Llama 3.x JSON {"name": ..., "parameters": ...}); tool_choice required and named calls are '
                "generated in it",
                _MODEL,
                parser=_tool_call_parser,
                metavar="auto|hermes|llama3",
            ),
        ] = _DEFAULT.tool_call_parser,
        speculative_config: Annotated[
            str | None,
            _opt(
                "speculative_config",
                "vLLM-style JSON: method, model, num_speculative_tokens, draft_tensor_parallel_size, max_model_len",
                _SPEC,
            ),
        ] = _DEFAULT.speculative_config,
        draft_max_model_len: Annotated[
            int | None,
            _opt(
                "draft_max_model_len", "drafter context cap (--speculative-config max_model_len): >= the context", _SPEC
            ),
        ] = _DEFAULT.draft_max_model_len,
        shutdown_timeout: Annotated[
            float, _opt("shutdown_timeout", "seconds to let in-flight requests finish after SIGTERM", _RUN)
        ] = _DEFAULT.shutdown_timeout,
        compilation_cache_dir: Annotated[
            str | None,
            _opt(
                "compilation_cache_dir",
                "JAX persistent compilation cache directory (default: $JAX_COMPILATION_CACHE_DIR if set, else"
                f" {DEFAULT_COMPILATION_CACHE_DIR})",
                _RUN,
            ),
        ] = _DEFAULT.compilation_cache_dir,
        warmup: Annotated[
            bool,
            _opt(
                "warmup",
                "compile the common step shapes before serving (every batch size, verify width and the first two "
                "context lengths); off: /health answers once the model is loaded and each shape compiles on its first "
                "use (a faster start, a pause at each new shape)",
                _RUN,
                negatable=True,
            ),
        ] = _DEFAULT.warmup,
        warmup_background: Annotated[
            bool,
            _opt(
                "warmup_background",
                "serve once the batch-1 programs are compiled and compile the other batch sizes in the background (a"
                " step that needs one waits for it); off: /health answers only when every warm-up program is ready",
                _RUN,
                negatable=True,
            ),
        ] = _DEFAULT.warmup_background,
        max_request_bytes: Annotated[
            int, _opt("max_request_bytes", "largest accepted request body in bytes (larger: 413)", _HTTP)
        ] = _DEFAULT.max_request_bytes,
        log_level: Annotated[
            str, _opt("log_level", "log level: debug | info | warning | error", _RUN)
        ] = _DEFAULT.log_level,
        kv_cache_memory: Annotated[
            int | None,
            _opt(
                "kv_cache_memory",
                "bytes of the KV page pool, target and drafter caches together: an integer or a number with a unit "
                "(8GiB, 500MB); at most one of this and --gpu-memory-utilization; neither: the pool holds "
                "--max-num-seqs full-length sequences",
                _KV,
                parser=_byte_count,
                metavar="BYTES",
            ),
        ] = _DEFAULT.kv_cache_memory,
        gpu_memory_utilization: Annotated[
            float | None,
            _opt(
                "gpu_memory_utilization",
                "fraction 0 < f <= 1 of the device's memory (on CPU: host RAM) for weights, activations and the KV "
                "pool: the pool gets f x total - the memory in use once the weights are loaded - an activation "
                "reserve (total and in use as the first device's allocator reports them; with --tp-size > 1 the "
                "pool is sized as if that device held all of it)",
                _KV,
            ),
        ] = _DEFAULT.gpu_memory_utilization,
        block_size: Annotated[
            int,
            _opt("block_size", f"tokens per KV page: {' | '.join(map(str, PAGE_SIZES))}", _KV),
        ] = _DEFAULT.block_size,
        enable_prefix_caching: Annotated[
            bool,
            _opt(
                "enable_prefix_caching",
                "share the KV pages of a prompt prefix already computed (whole pages) between requests",
                _KV,
                negatable=True,
            ),
        ] = _DEFAULT.enable_prefix_caching,
    ) -> None:
        try:
            config = config_from_context(ctx)
        except UserError as e:
            typer.echo(f"error: {e}", err=True)
            raise typer.Exit(2) from None
        raise typer.Exit(start(config))

    if doc is not None:
        serve.__doc__ = doc
    return serve
