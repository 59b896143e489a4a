"""`dflash-jax serve`: the OpenAI-compatible server (filled in by the serving issue)."""

from __future__ import annotations

import typer


def serve() -> None:
    """Serve the OpenAI-compatible HTTP API (not implemented yet)."""
    typer.echo("error: serve is not implemented yet; use `dflash-jax generate`", err=True)
    raise typer.Exit(2)
