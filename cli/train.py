"""`dflash-jax train ...` commands."""

from __future__ import annotations

import typer

app = typer.Typer(help="train commands", no_args_is_help=True)
