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
from dflash_jax.engine.offline import OfflineEngine
from dflash_jax.errors import UserError
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
    kv_cache_bytes,
    weight_bytes_by_tier,
)
from dflash_jax.spec_decode.control.controller import Controller
from dflash_jax.spec_decode.control.gamma import require_drafter
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


def build_runner(models: Models, *, max_slots: int, max_model_len: int, gamma: int | None = None, **kw) -> SpecRunner:
    """The runner for `models` (plain decoding without a drafter); `kw` goes to `SpecRunner` (mesh, timing)."""
    return SpecRunner(
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
):
    """The speculation controller for the flags (None without a drafter; flags that need one are refused)."""
    if drafter is None:
        require_drafter(False, dflash_adaptive_k=adaptive_k, dflash_draft_ladder=draft_ladder, dflash_gamma=gamma)
        return None
    if gamma is None and drafter.cfg.measured_gamma:
        gamma = drafter.cfg.measured_gamma  # `bench decode` showed it beats min(block + 2, 15) for this drafter
    return Controller.from_flags(
        adaptive_k=adaptive_k,
        draft_ladder=draft_ladder,
        gamma=gamma,
        block_size=drafter.cfg.block_size,
        has_drafter=True,
    )


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
    return OfflineEngine(runner, models.target.tokenizer, max_num_seqs=max_num_seqs, controller=ctl)


def _host_available_bytes() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


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
    `max_model_len + gamma + 1` positions."""
    tm = models.target.model
    tc = models.target.cfg
    itemsize = int(np.dtype(tm.dtype).itemsize)
    if kv_tokens is None:
        kv_tokens = (max_slots + 1) * (max_model_len + gamma + 1)
    target_w = param_count(tc) * itemsize + (tc.vocab_size * tc.hidden_size * itemsize if tc.tie_word_embeddings else 0)
    target_kv = kv_cache_bytes(
        layers=tc.num_layers,
        kv_heads=tc.num_kv_heads,
        head_dim=tc.head_dim,
        slots=1,
        max_len=kv_tokens,
        dtype=tm.dtype,
    )
    budget = {"target_weights": target_w, "target_kv_cache": target_kv}
    free, _ = device_memory()
    if free is None:
        free = _host_available_bytes()
    dtypes = f" ({np.dtype(tm.dtype).name})"
    if models.drafter is None:
        log(f"memory: target weights {format_bytes(target_w)}, KV {format_bytes(target_kv)}{dtypes}")
        return budget
    dc = models.drafter.cfg
    weights = _declared_shapes(models.drafter)
    head = tm.lm_head
    weights["lm_head.weight"] = jax.ShapeDtypeStruct((tc.vocab_size, tc.hidden_size), head[...].dtype)
    by_tier = weight_bytes_by_tier(weights)
    d_kv = kv_cache_bytes(
        layers=dc.num_layers,
        kv_heads=dc.num_kv_heads,
        head_dim=dc.head_dim,
        slots=1,
        max_len=kv_tokens,
        dtype=models.drafter.dtype,
    )
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
