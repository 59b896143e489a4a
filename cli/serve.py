"""`dflash-jax serve`: the OpenAI-compatible server with continuous batching and DFlash speculation.

Multi-host (`--coordinator-address/--num-processes/--process-id`): every process loads the same models onto one
mesh over all processes' devices; process 0 serves HTTP and schedules, the others replay its device steps
(`server.launch.serve_or_follow`, `spec_decode.multihost`).

The flags and their `DFLASH_JAX_*` environment variables are defined in `dflash_jax.server.options`.
"""

from __future__ import annotations

from dflash_jax.cli._common import eprint, quiet_jax_logs, run_or_exit
from dflash_jax.server.config import DEFAULT_COMPILATION_CACHE_DIR, ServeConfig
from dflash_jax.server.options import serve_command


def compilation_cache_dir(cfg: ServeConfig) -> str:
    """`--compilation-cache-dir`, else JAX's own `JAX_COMPILATION_CACHE_DIR`, else `DEFAULT_COMPILATION_CACHE_DIR`."""
    import os
    from pathlib import Path

    return (
        cfg.compilation_cache_dir
        or os.environ.get("JAX_COMPILATION_CACHE_DIR")
        or str(Path(DEFAULT_COMPILATION_CACHE_DIR).expanduser())
    )


def _start(cfg: ServeConfig) -> int:
    from dataclasses import replace

    from dflash_jax.server.launch import enable_compilation_cache, serve_or_follow

    enable_compilation_cache(compilation_cache_dir(cfg))
    quiet_jax_logs()
    from dflash_jax.builder import build_serving
    from dflash_jax.cli._tp import parallel_kwargs
    from dflash_jax.compilation import cancel_background_compiles

    par = parallel_kwargs(
        cfg.tp_size,
        cfg.draft_tp_size,
        coordinator_address=cfg.coordinator_address,
        num_processes=cfg.num_processes,
        process_id=cfg.process_id,
    )
    s = build_serving(cfg, **par, log=eprint)
    bg = cfg.warmup_background
    # Multi-host (--num-processes N): process 0 serves HTTP and schedules; the others replay its device steps.
    try:
        return serve_or_follow(
            replace(cfg, step_token_budget=s.step_token_budget, tool_call_parser=s.tool_call_parser),
            s.runner,
            s.tokenizer,
            model_name=s.model_name,
            controller=s.controller,
            warmup=(lambda: eprint(f"dflash-jax serve: warm-up: {s.runner.warmup(background=bg).summary()}"))
            if cfg.warmup
            else None,
            memory_budget=s.memory_budget,
        )
    finally:  # a server stopped during its background warm-up exits without compiling the rest
        cancel_background_compiles()


def _run(cfg: ServeConfig) -> int:
    return run_or_exit(lambda: _start(cfg))


serve = serve_command(
    _run,
    doc="""Serve the OpenAI-compatible API (completions, chat, SSE, /health, /metrics) with DFlash speculation.

    Every flag can also be set by its DFLASH_JAX_* environment variable (e.g. DFLASH_JAX_MAX_NUM_SEQS).

    Multi-host: run the same command on every host with --coordinator-address HOST:PORT --num-processes N
    --process-id I and --tp-size = all devices of all hosts; process 0 serves HTTP, the others follow its steps.""",
)
