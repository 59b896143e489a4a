"""`dflash-jax serve`: the OpenAI-compatible server with continuous batching and DFlash speculation.

Multi-host (`--coordinator-address/--num-processes/--process-id`): every process loads the same models onto one
mesh over all processes' devices; process 0 serves HTTP and schedules, the others replay its device steps
(`server.launch.serve_or_follow`, `spec_decode.multihost`).

The flags and their `DFLASH_JAX_*` environment variables are defined in `dflash_jax.server.options`.
"""

from __future__ import annotations

from dflash_jax.cli._common import eprint, quiet_jax_logs, run_or_exit
from dflash_jax.errors import UserError
from dflash_jax.server.config import ServeConfig
from dflash_jax.server.options import serve_command

DEFAULT_SERVE_MAX_MODEL_LEN = 2048
DEFAULT_CACHE_DIR = "~/.cache/dflash-jax/jax-compilation-cache"


def _start(cfg: ServeConfig) -> int:
    from pathlib import Path

    from dflash_jax.server.launch import enable_compilation_cache, serve_or_follow

    enable_compilation_cache(cfg.compilation_cache_dir or str(Path(DEFAULT_CACHE_DIR).expanduser()))
    quiet_jax_logs()
    from dflash_jax.builder import build_runner, load_models, make_controller, resolve_dtype
    from dflash_jax.cli._tp import parallel_kwargs

    par = parallel_kwargs(
        cfg.tp_size,
        cfg.draft_tp_size,
        coordinator_address=cfg.coordinator_address,
        num_processes=cfg.num_processes,
        process_id=cfg.process_id,
    )
    draft = None if cfg.no_spec else (cfg.draft_model or "default")
    models = load_models(
        cfg.model,
        draft,
        resolve_dtype(cfg.dtype),
        quant=cfg.draft_weight_quantization,
        kernel_backend=cfg.kernel_backend,
        mesh=par.get("mesh"),
    )
    lt, drafter = models.target, models.drafter
    max_len = cfg.max_model_len or min(lt.cfg.max_position_embeddings, DEFAULT_SERVE_MAX_MODEL_LEN)
    if cfg.draft_max_model_len is not None and cfg.draft_max_model_len < max_len:
        raise UserError(
            f"--draft-max-model-len {cfg.draft_max_model_len} is below the context length {max_len}: the drafter's "
            "context always covers the whole sequence; drop it, or lower --max-model-len to it",
            param="--draft-max-model-len",
        )
    tokenizer = lt.tokenizer if cfg.tokenizer is None else load_tokenizer(cfg.tokenizer, lt.cfg.vocab_size)
    ctl = make_controller(
        drafter, gamma=cfg.dflash_gamma, adaptive_k=cfg.dflash_adaptive_k, draft_ladder=cfg.dflash_draft_ladder
    )
    gamma = ctl.max_drafts + 1 if ctl is not None else None
    from dflash_jax.builder import memory_preflight

    pool = _plan_pool(cfg, models, max_len, gamma)
    budget = memory_preflight(
        models,
        max_slots=cfg.max_num_seqs,
        max_model_len=max_len,
        gamma=gamma or 1,
        tier=cfg.draft_weight_quantization,
        kv_tokens=pool.num_pages * pool.page_size,
        log=eprint,
    )
    budget["kv_pool"] = pool.nbytes
    runner = build_runner(
        models,
        max_slots=cfg.max_num_seqs,
        max_model_len=max_len,
        gamma=gamma,
        max_num_batched_tokens=cfg.max_num_batched_tokens,
        attention_backend=cfg.attention_backend,
        **par,
        **pool.runner_kwargs(),
    )
    eprint(
        f"dflash-jax serve: {lt.model_id} ({lt.source}); drafter: {draft or 'none'}"
        + (f", γ={runner.gamma}, control={ctl.mode}" if ctl else "")
        + f"; dtype {lt.model.dtype.name}; slots {cfg.max_num_seqs}, max_model_len {max_len}"
        + f", max_num_batched_tokens {cfg.max_num_batched_tokens}"
    )
    from dflash_jax.server.kv_pool import describe_pool

    pages = runner.pages  # the pool as allocated
    eprint(
        describe_pool(pages.total, pages.page_size, pool.bytes_per_token, max_len, prefix_caching=pages.prefix_caching)
    )
    # Multi-host (--num-processes N): process 0 serves HTTP and schedules; the others replay its device steps.
    return serve_or_follow(
        cfg,
        runner,
        tokenizer,
        model_name=cfg.served_model_name or ("default" if cfg.model == "default" else lt.model_id),
        controller=ctl,
        warmup=lambda: eprint(f"dflash-jax serve: warm-up: {runner.warmup().summary()}"),
        memory_budget=budget,
    )


def _plan_pool(cfg: ServeConfig, models, max_len: int, gamma: int | None):
    """The KV pool for the serve flags, from the loaded models (their cache dtype, the device memory in use)."""
    from dflash_jax.quant.memory import activation_reserve_bytes, kv_bytes_per_token, memory_agreed_by_all_processes
    from dflash_jax.server.kv_pool import plan_kv_pool

    lt, drafter = models.target, models.drafter
    width = (gamma or drafter.cfg.block_size) if drafter is not None else 1  # the runner's verify width
    dtype = lt.model.dtype
    rows = max(cfg.max_num_seqs * width, cfg.max_num_batched_tokens)
    return plan_kv_pool(
        cfg,
        bytes_per_token=kv_bytes_per_token(lt.cfg, drafter.cfg if drafter is not None else None, dtype),
        max_model_len=max_len,
        gamma=width,
        memory=memory_agreed_by_all_processes() if cfg.gpu_memory_utilization is not None else (None, None),
        reserve_bytes=activation_reserve_bytes(lt.cfg, rows=rows, dtype=dtype),
    )


def load_tokenizer(path: str, vocab_size: int):
    """`--tokenizer`: a Hugging Face tokenizer directory (tokenizer.json, tokenizer_config.json) for this model."""
    from pathlib import Path

    from dflash_jax.checkpoints.tokenizer import load_hf_tokenizer

    d = Path(path).expanduser()
    if not d.is_dir():
        raise UserError(f"--tokenizer: {path!r} is not a directory with a tokenizer.json", param="--tokenizer")
    tok = load_hf_tokenizer(d)
    if tok.vocab_size > vocab_size:
        raise UserError(
            f"--tokenizer: {path} has {tok.vocab_size} tokens, more than the model's vocabulary of {vocab_size}",
            param="--tokenizer",
        )
    return tok


def _run(cfg: ServeConfig) -> int:
    return run_or_exit(lambda: _start(cfg))


serve = serve_command(
    _run,
    doc="""Serve the OpenAI-compatible API (completions, chat, SSE, /health, /metrics) with DFlash speculation.

    Every flag can also be set by its DFLASH_JAX_* environment variable (e.g. DFLASH_JAX_MAX_NUM_SEQS).

    Multi-host: run the same command on every host with --coordinator-address HOST:PORT --num-processes N
    --process-id I and --tp-size = all devices of all hosts; process 0 serves HTTP, the others follow its steps.""",
)
