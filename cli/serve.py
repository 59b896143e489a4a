"""`dflash-jax serve`: the OpenAI-compatible server with continuous batching and DFlash speculation.

Multi-host (`--coordinator-address/--num-processes/--process-id`): every process loads the same models onto one
mesh over all processes' devices; process 0 serves HTTP and schedules, the others replay its device steps
(`server.launch.serve_or_follow`, `spec_decode.multihost`).

The typer options are generated from `ServeConfig`'s fields (one flag per field, its help from the field), so
the flags, the `DFLASH_JAX_*` environment variables and the config dataclass never drift apart.
"""

from __future__ import annotations

import inspect
import typing
from dataclasses import MISSING

import typer

from dflash_jax.cli._common import eprint, quiet_jax_logs, run_or_exit
from dflash_jax.server.config import ServeConfig, flag_name

DEFAULT_SERVE_MAX_MODEL_LEN = 2048
DEFAULT_CACHE_DIR = "~/.cache/dflash-jax/jax-compilation-cache"


def _start(values: dict) -> None:
    from pathlib import Path

    from dflash_jax.cli.serve_args import build_serve_config
    from dflash_jax.server.launch import enable_compilation_cache, serve_or_follow

    cfg = build_serve_config(values)
    enable_compilation_cache(cfg.compilation_cache_dir or str(Path(DEFAULT_CACHE_DIR).expanduser()))
    quiet_jax_logs()
    from dflash_jax.builder import build_runner, load_models, make_controller
    from dflash_jax.cli._tp import parallel_kwargs

    par = parallel_kwargs(
        cfg.tp_size,
        cfg.draft_tp_size,
        coordinator_address=cfg.coordinator_address,
        num_processes=cfg.num_processes,
        process_id=cfg.process_id,
    )
    draft = None if cfg.no_spec else (cfg.draft_model or "default")
    models = load_models(cfg.model, draft, quant=cfg.draft_weight_quantization, kernel_backend=cfg.kernel_backend)
    lt, drafter = models.target, models.drafter
    max_len = cfg.max_model_len or min(lt.cfg.max_position_embeddings, DEFAULT_SERVE_MAX_MODEL_LEN)
    ctl = make_controller(
        drafter, gamma=cfg.dflash_gamma, adaptive_k=cfg.dflash_adaptive_k, draft_ladder=cfg.dflash_draft_ladder
    )
    gamma = ctl.max_drafts + 1 if ctl is not None else None
    from dflash_jax.builder import memory_preflight

    budget = memory_preflight(
        models,
        max_slots=cfg.max_num_seqs,
        max_model_len=max_len,
        gamma=gamma or 1,
        tier=cfg.draft_weight_quantization,
        log=eprint,
    )
    runner = build_runner(models, max_slots=cfg.max_num_seqs, max_model_len=max_len, gamma=gamma, **par)
    eprint(
        f"dflash-jax serve: {lt.model_id} ({lt.source}); drafter: {draft or 'none'}"
        + (f", γ={runner.gamma}, control={ctl.mode}" if ctl else "")
        + f"; slots {cfg.max_num_seqs}, max_model_len {max_len}"
    )
    # Multi-host (--num-processes N): process 0 serves HTTP and schedules; the others replay its device steps.
    raise typer.Exit(
        serve_or_follow(
            cfg,
            runner,
            lt.tokenizer,
            model_name=cfg.served_model_name or ("default" if cfg.model == "default" else lt.model_id),
            controller=ctl,
            warmup=runner.warmup,
            memory_budget=budget,
        )
    )


def _build_command():
    params = []
    for f in ServeConfig.__dataclass_fields__.values():
        default = f.default if f.default is not MISSING else None
        hint = typing.get_type_hints(ServeConfig)[f.name]
        base = next((a for a in typing.get_args(hint) if a is not type(None)), hint) if typing.get_args(hint) else hint
        if base is bool:
            opt = typer.Option(False, flag_name(f.name), is_flag=True, help=f.metadata.get("help", ""))
            ann = bool
        else:
            opt = typer.Option(None, flag_name(f.name), help=f"{f.metadata.get('help', '')} [default: {default}]")
            ann = base | None
        params.append(inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=opt, annotation=ann))

    def serve(**values) -> None:
        """Serve the OpenAI-compatible API (completions, chat, SSE, /health, /metrics) with DFlash speculation.

        Every flag can also be set by its DFLASH_JAX_* environment variable (e.g. DFLASH_JAX_MAX_NUM_SEQS).

        Multi-host: run the same command on every host with --coordinator-address HOST:PORT --num-processes N
        --process-id I and --tp-size = all devices of all hosts; process 0 serves HTTP, the others follow its steps."""
        run_or_exit(lambda: _start(values))

    serve.__signature__ = inspect.Signature(params)
    return serve


serve = _build_command()
