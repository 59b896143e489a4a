"""`dflash-jax quantize`: write a quantized drafter checkpoint (filled in by the quantization issue)."""

from __future__ import annotations

import typer


def quantize() -> None:
    """Write a quantized drafter checkpoint (not implemented yet)."""
    typer.echo("error: quantize is not implemented yet", err=True)
    raise typer.Exit(2)
