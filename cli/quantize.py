"""`dflash-jax quantize`: write a drafter checkpoint quantized to a `--draft-weight-quantization` tier."""

from __future__ import annotations

import json
from pathlib import Path

import typer

from dflash_jax.cli._common import eprint, run_or_exit


def quantize(
    draft_model: str = typer.Option(..., "--draft-model", help="DFlash drafter directory (or 'default')."),
    out: Path = typer.Option(..., "--out", help="Output directory (config.json + model.safetensors)."),
    tier: str = typer.Option("fp8", "--draft-weight-quantization", help="fp8 | fp8-aux | nvfp4"),
    model: str = typer.Option("default", "--model", help="The target (its LM head is copied for the drafter)."),
) -> None:
    """Quantize a drafter's weights (and its copy of the LM head) once; the result loads directly."""

    def body():
        from dflash_jax.builder import DEFAULT_DRAFTER_DIR, load_models
        from dflash_jax.checkpoints.export import drafter_weights_as_stored
        from dflash_jax.errors import UserError
        from dflash_jax.quant import is_quantized, parse_tier
        from dflash_jax.quant.io import save_quantized

        t = parse_tier(tier)
        if t == "declared":
            raise UserError(
                "--draft-weight-quantization declared writes nothing new; pick fp8, fp8-aux or nvfp4",
                param="--draft-weight-quantization",
            )
        m = load_models(model, draft_model, quant=t)
        src = DEFAULT_DRAFTER_DIR if draft_model == "default" else Path(draft_model)
        cfg = json.loads((src / "config.json").read_text())
        cfg["dflash_jax_quantization"] = t
        weights = drafter_weights_as_stored(m.drafter)
        weights["lm_head.weight"] = m.draft_lm_head
        out.mkdir(parents=True, exist_ok=True)
        save_quantized(out, weights)
        (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
        n = sum(is_quantized(w) for w in weights.values())
        eprint(f"wrote {out} ({n} quantized tensors, tier {t})")

    run_or_exit(body)
