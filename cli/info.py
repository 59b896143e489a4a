"""`dflash-jax info`: architecture, parameter count, dtype and memory of a model."""

from __future__ import annotations

import typer

from dflash_jax.cli._common import run_or_exit


def info(
    model: str = typer.Option(
        "default", "--model", help="Target: HF directory, Hub repo id, .gguf file, or 'default'."
    ),
    dtype: str = typer.Option("auto", "--dtype", help="auto|bfloat16|float16|float32 (auto: bf16 on GPU, f32 on CPU)."),
) -> None:
    """Print the model's architecture, parameter count, dtype and weight memory."""

    def body():
        import jax.numpy as jnp

        from dflash_jax.builder import resolve_dtype
        from dflash_jax.checkpoints.hub import resolve_model_dir
        from dflash_jax.checkpoints.loader import load_target
        from dflash_jax.models.target import param_count

        dt = resolve_dtype(dtype)
        lt = load_target(resolve_model_dir(model, "--model"), dt)
        c = lt.cfg
        n = param_count(c)
        b = jnp.dtype(dt).itemsize
        typer.echo(f"model        {lt.model_id}  ({lt.source})")
        typer.echo(
            f"architecture {c.arch}: {c.num_layers} layers, hidden {c.hidden_size}, mlp {c.intermediate_size}, "
            f"heads {c.num_heads}/{c.num_kv_heads} (q/kv), head_dim {c.head_dim}, vocab {c.vocab_size}"
        )
        scaling = c.rope_scaling.rope_type if c.rope_scaling else "none"
        typer.echo(
            f"rope         theta {c.rope_theta:g}, scaling {scaling}; tied embeddings: {c.tie_word_embeddings}"
            f"; max positions {c.max_position_embeddings}"
        )
        typer.echo(f"parameters   {n:,}")
        extra = c.vocab_size * c.hidden_size * b if c.tie_word_embeddings else 0
        typer.echo(
            f"dtype        {jnp.dtype(dt).name}; weights {n * b / 2**20:.1f} MiB"
            + (f" (+{extra / 2**20:.1f} MiB transposed LM-head copy for fast decode)" if extra else "")
        )
        kv = 2 * c.num_layers * c.num_kv_heads * c.head_dim * b
        typer.echo(f"kv cache     {kv / 1024:.1f} KiB per token per sequence")

    run_or_exit(body)
