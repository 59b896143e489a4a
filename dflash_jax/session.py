"""Build the models and the runner from user-facing options (shared by generate, bench and serve)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from dflash_jax.checkpoints.loader import LoadedTarget, load_target
from dflash_jax.errors import UserError
from dflash_jax.models.drafter import DrafterModel, load_drafter, random_drafter_config
from dflash_jax.models.layers import RandomBuilder
from dflash_jax.spec.runner import SpecRunner

DEFAULT_DRAFTER_DIR = Path(__file__).parent / "drafters" / "smollm2-135m-dflash"


def resolve_dtype(dtype: str):
    if dtype == "auto":
        return jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16
    if dtype in ("float32", "f32"):
        return jnp.float32
    if dtype in ("bfloat16", "bf16"):
        return jnp.bfloat16
    raise UserError(f"--dtype must be auto, float32 or bfloat16, got {dtype!r}", param="--dtype")


def load_draft(spec: str | None, lt: LoadedTarget, is_default_target: bool, dtype=jnp.float32) -> DrafterModel | None:
    """`None` → no speculation; `default` → the committed drafter of the default model; `random[:LAYERS]` →
    a random-weight drafter shaped for the target (to exercise the machinery); otherwise a drafter directory."""
    if spec is None or spec in ("", "none"):
        return None
    if spec == "default":
        if not is_default_target:
            raise UserError("--draft-model default only exists for the default target; give a drafter directory",
                            param="--draft-model")
        if not (DEFAULT_DRAFTER_DIR / "config.json").exists():
            raise UserError(f"the default drafter is missing ({DEFAULT_DRAFTER_DIR}); train one with "
                            "`dflash-jax train drafter` or pass --draft-model random", param="--draft-model")
        return load_drafter(DEFAULT_DRAFTER_DIR, lt.cfg, dtype)
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
        return DrafterModel(random_drafter_config(lt.cfg, layers), lt.cfg.hidden_size, RandomBuilder(1234, dtype=dtype))
    return load_drafter(spec, lt.cfg, dtype)


class Models(NamedTuple):
    target: LoadedTarget
    drafter: DrafterModel | None
    draft_lm_head: Any  # the drafter's copy of the LM head (quantized per tier), or None


def load_models(model: str | None, draft_model: str | None, dtype=jnp.float32, quant: str = "declared") -> Models:
    """Target + optional drafter; `quant` is the `--draft-weight-quantization` tier applied to the drafter."""
    from dflash_jax.checkpoints.export import apply_weight_tier
    from dflash_jax.quant import parse_tier

    tier = parse_tier(quant)
    lt = load_target(model, dtype)
    is_default = model in (None, "", "default")
    drafter = load_draft(draft_model, lt, is_default, dtype)
    head = apply_weight_tier(drafter, lt.model.lm_head[...], tier) if drafter is not None else None
    return Models(lt, drafter, head)


def build_runner(models: Models, *, max_slots: int, max_model_len: int, gamma: int | None = None,
                 **kw) -> SpecRunner:
    return SpecRunner(models.target.model, models.drafter, max_slots=max_slots, max_model_len=max_model_len,
                      gamma=gamma, draft_lm_head=models.draft_lm_head, **kw)


def make_controller(drafter: DrafterModel | None, *, gamma: int | None = None, adaptive_k: str | None = None,
                    draft_ladder: str | None = None):
    """The speculation controller for the flags (None without a drafter; flags that need one are refused)."""
    from dflash_jax.spec.control.controller import Controller
    from dflash_jax.spec.control.gamma import require_drafter

    if drafter is None:
        require_drafter(False, dflash_adaptive_k=adaptive_k, dflash_draft_ladder=draft_ladder, dflash_gamma=gamma)
        return None
    return Controller.from_flags(adaptive_k=adaptive_k, draft_ladder=draft_ladder, gamma=gamma,
                                 block_size=drafter.cfg.block_size, has_drafter=True)
