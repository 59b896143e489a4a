"""The `dflash-jax` command line (typer). Each command module is thin: parse flags, build config, call the library."""

from __future__ import annotations

import typer

from dflash_jax.cli import bench, generate, info, quantize, serve, spec, train

app = typer.Typer(
    name="dflash-jax",
    help="LLM inference on JAX/XLA with DFlash speculative decoding.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)
app.command("generate")(generate.generate)
app.command("info")(info.info)
app.command("serve")(serve.serve)
app.command("quantize")(quantize.quantize)
app.add_typer(bench.app, name="bench")
app.add_typer(train.app, name="train")
app.add_typer(spec.app, name="spec")


def main() -> None:  # pragma: no cover - entry point
    app()


if __name__ == "__main__":  # pragma: no cover
    main()
