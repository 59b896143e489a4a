"""Build the models, the runner and the draft-count controller from user-facing options (shared by generate,
bench and serve). The controller belongs to the engine, which passes its per-step draft counts to the runner."""

from __future__ import annotations

from pathlib import Path
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from dflash_jax.checkpoints.drafter import load_drafter_and_head
from dflash_jax.checkpoints.export import apply_weight_tier
from dflash_jax.checkpoints.hub import resolve_model_dir
from dflash_jax.checkpoints.loader import LoadedTarget, load_target
from dflash_jax.checkpoints.names import attr_to_key, is_table
from dflash_jax.checkpoints.tokenizer import resolve_tool_call_parser
from dflash_jax.engine.offline import OfflineEngine
from dflash_jax.errors import UserError
from dflash_jax.kv.sizing import (
    KVPoolPlan,
    activation_reserve_bytes,
    describe_pool,
    host_memory_in_use_and_total,
    kv_bytes_per_token,
    layer_kv_bytes_per_token,
    plan_kv_pool,
    seq_positions,
    verify_width,
)
from dflash_jax.models.drafter import DrafterModel, random_drafter_config
from dflash_jax.models.layers import RandomBuilder
from dflash_jax.models.target import param_count
from dflash_jax.parallel.rules import MeshPlacement
from dflash_jax.quant import is_quantized, parse_tier, resolve_kernel_backend
from dflash_jax.quant.memory import (
    MemoryEstimate,
    check_fits,
    device_memory,
    format_bytes,
    memory_agreed_by_all_processes,
    weight_bytes_by_tier,
)
from dflash_jax.spec_decode.control.controller import Controller
from dflash_jax.spec_decode.control.gamma import require_drafter
from dflash_jax.spec_decode.ngram import HybridRunner
from dflash_jax.spec_decode.runner import SpecRunner

DEFAULT_DRAFTER_DIR = Path(__file__).parent / "drafters" / "smollm2-135m-dflash"


DTYPES = {"bfloat16": jnp.bfloat16, "float16": jnp.float16, "float32": jnp.float32}


def resolve_dtype(dtype: str):
    """`--dtype` -> a jnp dtype. auto: float32 on CPU, bfloat16 on an accelerator."""
    if dtype == "auto":
        return jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16
    if dtype in DTYPES:
        return DTYPES[dtype]
    raise UserError(f"--dtype must be auto, {', '.join(DTYPES)}, got {dtype!r}", param="--dtype")


def load_draft(
    spec: str | None, lt: LoadedTarget, is_default_target: bool, dtype=jnp.float32, kernel_backend: str = "xla"
):
    """(drafter, prequantized LM-head copy or None). `None` → no speculation; `default` → the committed drafter of
    the default model; `random[:LAYERS]` → a random-weight drafter shaped for the target (to exercise the
    machinery); otherwise a drafter directory or Hub repo id. A prequantized checkpoint's weights run on
    `kernel_backend`."""
    if spec is None or spec in ("", "none"):
        return None, None
    if spec == "default":
        if not is_default_target:
            raise UserError(
                "--draft-model default only exists for the default target; give a drafter directory",
                param="--draft-model",
            )
        if not (DEFAULT_DRAFTER_DIR / "config.json").exists():
            raise UserError(
                f"the default drafter is missing ({DEFAULT_DRAFTER_DIR}); train one with "
                "`dflash-jax train drafter` or pass --draft-model random",
                param="--draft-model",
            )
        return load_drafter_and_head(DEFAULT_DRAFTER_DIR, lt.cfg, dtype, kernel_backend)
    if spec.startswith("random"):
        _, _, n = spec.partition(":")
        try:
            layers = int(n) if n else 1
        except ValueError:
            raise UserError(
                f"--draft-model random:LAYERS needs an integer, got {spec!r}", param="--draft-model"
            ) from None
        if layers < 1:
            raise UserError("--draft-model random:LAYERS needs at least 1 layer", param="--draft-model")
        cfg = random_drafter_config(lt.cfg, layers)
        return DrafterModel(cfg, lt.cfg.hidden_size, RandomBuilder(1234, dtype=dtype)), None
    return load_drafter_and_head(resolve_model_dir(spec, "--draft-model"), lt.cfg, dtype, kernel_backend)


class Models(NamedTuple):
    target: LoadedTarget
    drafter: DrafterModel | None
    draft_lm_head: Any  # the drafter's copy of the LM head (quantized per tier), or None


def load_models(
    model: str | None,
    draft_model: str | None,
    dtype=jnp.float32,
    quant: str = "declared",
    kernel_backend: str = "auto",
    mesh: Mesh | None = None,
) -> Models:
    """Target + optional drafter (each a local path or a Hub repo id), weights in `dtype`; `quant` is the
    `--draft-weight-quantization` tier applied to the drafter and `kernel_backend` the `--kernel-backend` its
    quantized matmuls use (auto: XLA on CPU, Pallas on GPU). With a `mesh` every target tensor is loaded straight
    onto its shards (the runner then finds it placed)."""
    tier = parse_tier(quant)
    backend = resolve_kernel_backend(kernel_backend)
    is_default = model in (None, "", "default")
    source = resolve_model_dir(model, "--model")
    lt = load_target(source, dtype, MeshPlacement(mesh) if mesh is not None else None)
    if source != model:
        lt.model_id = model  # a Hub repo id names the model as the user typed it
    drafter, head = load_draft(draft_model, lt, is_default, dtype, backend)
    if drafter is not None and head is None:
        head = apply_weight_tier(drafter, lt.model.lm_head[...], tier, backend)
    return Models(lt, drafter, head)


def offline_context_len(models: Models, longest_prompt: int, max_tokens: int, *, spare: int = 8) -> int:
    """The context (max_model_len) of an offline run (generate, bench): the longest prompt plus `max_tokens`, and
    `spare` positions where the model has them. Refused past the model's `max_position_embeddings`, which serve
    also never exceeds by default."""
    limit = models.target.cfg.max_position_embeddings
    need = longest_prompt + max_tokens
    if need > limit:
        room = (
            f"lower --max-tokens to at most {limit - longest_prompt}"
            if longest_prompt < limit
            else "shorten the prompt"
        )
        raise UserError(
            f"--max-tokens: the prompt ({longest_prompt} tokens) plus --max-tokens {max_tokens} is {need} positions, "
            f"more than the model's max_position_embeddings ({limit}); {room}",
            param="--max-tokens",
        )
    return min(need + spare, limit)


def build_runner(
    models: Models,
    *,
    max_slots: int,
    max_model_len: int,
    gamma: int | None = None,
    runner_cls: type[SpecRunner] = SpecRunner,
    **kw,
) -> SpecRunner:
    """The runner for `models` (plain decoding without a drafter): a `runner_cls` (`SpecRunner` or a subclass such
    as the n-gram benchmark's); `kw` goes to its constructor (mesh, timing)."""
    return runner_cls(
        models.target.model,
        models.drafter,
        max_slots=max_slots,
        max_model_len=max_model_len,
        gamma=gamma,
        draft_lm_head=models.draft_lm_head,
        **kw,
    )


def make_controller(
    drafter: DrafterModel | None,
    *,
    gamma: int | None = None,
    adaptive_k: str | None = None,
    draft_ladder: str | None = None,
    objective: str | None = None,
):
    """The speculation controller for the flags (None without a drafter; flags that need one are refused)."""
    if drafter is None:
        require_drafter(
            False,
            dflash_adaptive_k=adaptive_k,
            dflash_objective=objective,
            dflash_draft_ladder=draft_ladder,
            dflash_gamma=gamma,
        )
        return None
    if gamma is None and drafter.cfg.measured_gamma:
        gamma = drafter.cfg.measured_gamma  # `bench decode` showed it beats min(block + 2, 15) for this drafter
    return Controller.from_flags(
        adaptive_k=adaptive_k,
        objective=objective,
        draft_ladder=draft_ladder,
        gamma=gamma,
        block_size=drafter.cfg.block_size,
        has_drafter=True,
        compiled_depths=True,
    )


def attach_grammar(runner: SpecRunner, tokenizer: Any, log=print) -> None:
    """Give the runner the matcher factory of constrained decoding (`engine.grammar`) for `tokenizer`; a tokenizer
    llguidance cannot read, or a Python without llguidance (the GPU host's packages), leaves the runner without one
    (constrained requests are then refused with a 400)."""
    if getattr(tokenizer, "tk", None) is None:
        return
    try:
        from dflash_jax.engine.grammar import GrammarCompiler
    except ImportError as e:
        if log is not None:
            log(f"dflash-jax serve: structured outputs are off: {e} (pip install llguidance)")
        return
    try:
        runner.grammar_compiler = GrammarCompiler.from_tokenizer(tokenizer, runner.cfg.vocab_size)
    except Exception as e:  # noqa: BLE001 - a tokenizer llguidance rejects: serving goes on without constraints
        if log is not None:
            log(f"dflash-jax serve: structured outputs are off: llguidance cannot read the tokenizer ({e})")


def build_offline_engine(
    models: Models,
    *,
    max_num_seqs: int,
    max_model_len: int,
    gamma: int | None = None,
    adaptive_k: str | None = None,
    draft_ladder: str | None = None,
    **runner_kw,
) -> OfflineEngine:
    """Runner + controller (from the speculation flags) + the engine that drives them, for offline use."""
    ctl = make_controller(models.drafter, gamma=gamma, adaptive_k=adaptive_k, draft_ladder=draft_ladder)
    runner = build_runner(
        models,
        max_slots=max_num_seqs,
        max_model_len=max_model_len,
        gamma=ctl.gamma if ctl is not None else None,
        **runner_kw,
    )
    attach_grammar(runner, models.target.tokenizer, log=None)
    return OfflineEngine(runner, models.target.tokenizer, max_num_seqs=max_num_seqs, controller=ctl)


def memory_preflight(
    models: Models,
    *,
    max_slots: int,
    max_model_len: int,
    gamma: int,
    tier: str,
    kv_tokens: int | None = None,
    log=print,
) -> dict[str, int]:
    """Print the drafter's bytes per tier (weights, KV, scratch) next to the target's and refuse to start when the
    device (or, on CPU, the host) cannot hold them. Returns the budget in bytes. Every term uses the dtypes the
    models hold: the weights' own, and each KV cache in its model's weight dtype (as the runner allocates it).
    `kv_tokens`: the positions of the KV page pool (null page included); None = `max_slots` + 1 sequences of
    `kv.sizing.seq_positions` positions."""
    tm = models.target.model
    tc = models.target.cfg
    itemsize = int(np.dtype(tm.dtype).itemsize)
    if kv_tokens is None:
        kv_tokens = (max_slots + 1) * seq_positions(max_model_len, gamma)
    target_w = param_count(tc) * itemsize + (tc.vocab_size * tc.hidden_size * itemsize if tc.tie_word_embeddings else 0)
    target_kv = layer_kv_bytes_per_token(tc, tm.dtype) * kv_tokens
    budget = {"target_weights": target_w, "target_kv_cache": target_kv}
    free, _ = device_memory()
    if free is None:
        in_use, total = host_memory_in_use_and_total()
        free = None if in_use is None or total is None else total - in_use
    dtypes = f" ({np.dtype(tm.dtype).name})"
    if models.drafter is None:
        log(f"memory: target weights {format_bytes(target_w)}, KV {format_bytes(target_kv)}{dtypes}")
        return budget
    dc = models.drafter.cfg
    weights = _declared_shapes(models.drafter)
    head = tm.lm_head
    weights["lm_head.weight"] = jax.ShapeDtypeStruct((tc.vocab_size, tc.hidden_size), head[...].dtype)
    by_tier = weight_bytes_by_tier(weights)
    d_kv = layer_kv_bytes_per_token(dc, models.drafter.dtype) * kv_tokens
    scratch = max_slots * gamma * tc.vocab_size * 4  # draft logits (f32)
    est = MemoryEstimate(tier=tier, weights=by_tier[tier], kv=d_kv, scratch=scratch)
    log(
        "memory: target weights "
        + format_bytes(target_w)
        + f", KV {format_bytes(target_kv)}{dtypes}; "
        + f"{est.describe()}; drafter weights by tier: "
        + ", ".join(f"{t} {format_bytes(b)}" for t, b in by_tier.items())
    )
    check_fits(est, target_bytes=target_w + target_kv, free_bytes=free, by_tier=by_tier)
    budget.update(drafter_weights=by_tier[tier], drafter_kv_cache=d_kv, drafter_scratch=scratch)
    return budget


def _declared_shapes(drafter: DrafterModel) -> dict:
    """The drafter's weights by z-lab key as shapes and dtypes in HF [out, in] layout (quantized weights as they
    are; the estimate needs no values)."""
    out = {}
    for path, var in nnx.to_flat_state(nnx.state(drafter, nnx.Param)):
        v = var[...]
        key = attr_to_key(".".join(str(p) for p in path))
        if is_quantized(v):
            out[key] = v
        else:
            shape = tuple(v.shape)[::-1] if v.ndim == 2 and not is_table(key) else tuple(v.shape)
            out[key] = jax.ShapeDtypeStruct(shape, v.dtype)
    return out


DEFAULT_SERVE_MAX_MODEL_LEN = 2048


# `--step-token-budget` by platform: the prompt tokens one mixed step carries (`engine.Engine`). CPU: measured
# (`benchmarks/mixed_step.py`, docs/benchmarks.md: 64 keeps the streams' longest gap within 5x their median, 128 does
# not); GPU: not measured, the 2048 tokens vLLM's scheduler budgets per step.
DEFAULT_STEP_TOKEN_BUDGETS = {"cpu": 64, "gpu": 2048}


def default_step_token_budget(platform: str | None = None) -> int:
    """The `--step-token-budget` default on `platform` (default: JAX's backend; other accelerators take the GPU's)."""
    platform = platform or jax.default_backend()
    return DEFAULT_STEP_TOKEN_BUDGETS.get(platform, DEFAULT_STEP_TOKEN_BUDGETS["gpu"])


def resolve_step_token_budget(asked: int | None, *, deterministic: bool = False) -> int:
    """`--step-token-budget`: as asked, else the platform's default; 0 under `--deterministic`, whose steps all run
    at one shape (a mixed step's target forward is a larger one, whose float rounding may differ)."""
    if deterministic:
        if asked:
            raise UserError(
                "--step-token-budget > 0 (mixed steps) cannot be combined with --deterministic, whose steps all run "
                "at one shape: drop one of them, or give --step-token-budget 0",
                param="--step-token-budget",
            )
        return 0
    return default_step_token_budget() if asked is None else asked


class Serving(NamedTuple):
    """What `serve` runs: the models, the runner (holding the one KV page pool the engine shares), the controller,
    the tokenizer, the pool's plan, the memory budget (for /metrics), the served model name and the resolved
    `--step-token-budget` and `--tool-call-parser`."""

    models: Models
    runner: SpecRunner
    controller: Controller | None
    tokenizer: Any
    pool: KVPoolPlan
    memory_budget: dict[str, int]
    model_name: str
    step_token_budget: int
    tool_call_parser: str


def load_tokenizer(path: str, vocab_size: int):
    """`--tokenizer`: a Hugging Face tokenizer directory (tokenizer.json, tokenizer_config.json) for this model."""
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


def plan_serve_pool(cfg: Any, models: Models, max_model_len: int, gamma: int | None) -> KVPoolPlan:
    """The KV pool for the serve flags of `cfg` (a `server.config.ServeConfig`), from the loaded models: their
    cache dtype, and the device memory in use for `--gpu-memory-utilization`."""
    lt, drafter = models.target, models.drafter
    width = verify_width(gamma, drafter.cfg.block_size if drafter is not None else None)
    dtype = lt.model.dtype
    rows = max(cfg.max_num_seqs * width, cfg.max_num_batched_tokens)
    bpt = kv_bytes_per_token(lt.cfg, drafter.cfg if drafter is not None else None, dtype)
    memory = memory_agreed_by_all_processes() if cfg.gpu_memory_utilization is not None else (None, None)
    reserve = activation_reserve_bytes(lt.cfg, rows=rows, dtype=dtype)
    plan = dict(bytes_per_token=bpt, max_model_len=max_model_len, width=width, memory=memory, reserve_bytes=reserve)
    return plan_kv_pool(cfg.pool_flags(), **plan)


def build_serving(cfg: Any, *, mesh: Mesh | None = None, draft_tp: str | int | None = "auto", log=print) -> Serving:
    """Everything `serve` needs from its flags (`cfg`: a `server.config.ServeConfig`): the models, the controller,
    the KV pool (sized once here and handed to the runner, whose `pages` the engine reads), the memory preflight
    and the runner. `mesh`, `draft_tp`: tensor parallelism (`cli._tp.parallel_kwargs`)."""
    draft = None if cfg.no_spec else (cfg.draft_model or "default")
    models = load_models(
        cfg.model,
        draft,
        resolve_dtype(cfg.dtype),
        quant=cfg.draft_weight_quantization,
        kernel_backend=cfg.kernel_backend,
        mesh=mesh,
    )
    lt = models.target
    max_len = cfg.max_model_len or min(lt.cfg.max_position_embeddings, DEFAULT_SERVE_MAX_MODEL_LEN)
    if cfg.draft_max_model_len is not None and cfg.draft_max_model_len < max_len:
        raise UserError(
            f"--draft-max-model-len {cfg.draft_max_model_len} is below the context length {max_len}: the drafter's "
            "context always covers the whole sequence; drop it, or lower --max-model-len to it",
            param="--draft-max-model-len",
        )
    tokenizer = lt.tokenizer if cfg.tokenizer is None else load_tokenizer(cfg.tokenizer, lt.cfg.vocab_size)
    tool_parser = resolve_tool_call_parser(cfg.tool_call_parser, tokenizer.rendered_template)
    ctl = make_controller(
        models.drafter,
        gamma=cfg.dflash_gamma,
        adaptive_k=cfg.dflash_adaptive_k,
        draft_ladder=cfg.dflash_draft_ladder,
        objective=cfg.dflash_objective,
    )
    gamma = ctl.max_drafts + 1 if ctl is not None else None
    pool = plan_serve_pool(cfg, models, max_len, gamma)
    budget = memory_preflight(
        models,
        max_slots=cfg.max_num_seqs,
        max_model_len=max_len,
        gamma=gamma or 1,
        tier=cfg.draft_weight_quantization,
        kv_tokens=pool.num_pages * pool.page_size,
        log=log,
    )
    budget["kv_pool"] = pool.nbytes
    par = {} if mesh is None else {"mesh": mesh, "draft_tp": draft_tp}
    step_budget = resolve_step_token_budget(cfg.step_token_budget, deterministic=cfg.deterministic)
    runner = build_runner(
        models,
        runner_cls=HybridRunner if (cfg.draft_method == "hybrid" and models.drafter is not None) else SpecRunner,
        max_slots=cfg.max_num_seqs,
        max_model_len=max_len,
        gamma=gamma,
        max_num_batched_tokens=cfg.max_num_batched_tokens,
        attention_backend=cfg.attention_backend,
        deterministic=cfg.deterministic,
        dense_layout=cfg.dense_layout,
        pool=pool.make_pool(),
        **par,
    )
    log(
        f"dflash-jax serve: {lt.model_id} ({lt.source}); drafter: {draft or 'none'}"
        + (f", γ={runner.gamma}, control={ctl.mode}, drafts {cfg.draft_method}" if ctl else "")
        + f"; dtype {lt.model.dtype.name}, dense layout {runner.dense_layout}"
        + f"; slots {cfg.max_num_seqs}, max_model_len {max_len}"
        + f", max_num_batched_tokens {cfg.max_num_batched_tokens}, step_token_budget {step_budget}"
        + f", tool_call_parser {tool_parser}"
    )
    attach_grammar(runner, tokenizer, log=log)
    pages = runner.pages
    log(describe_pool(pages.total, pages.page_size, pool.bytes_per_token, max_len, prefix_caching=pages.prefix_caching))
    name = cfg.served_model_name or ("default" if cfg.model == "default" else lt.model_id)
    return Serving(models, runner, ctl, tokenizer, pool, budget, name, step_budget, tool_parser)
