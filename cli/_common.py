"""Shared CLI helpers: run a command body and turn user errors into one clear line and exit code 2."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import TypeVar

import typer

from dflash_jax.errors import UserError

T = TypeVar("T")


def run_or_exit(fn: Callable[[], T]) -> T:
    """Call `fn`; a `UserError` prints `error: <message>` on stderr and exits 2 (no traceback)."""
    try:
        return fn()
    except UserError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from None
    except KeyboardInterrupt:
        raise typer.Exit(130) from None


def quiet_jax_logs() -> None:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")


def eprint(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


DENSE_LAYOUT_HELP = (
    "The matmul weights' layout in the steps: auto (out-in on CPU with one device, in-out elsewhere) | in-out (as "
    "loaded, x @ W) | out-in (an [out, in] copy read as W·xᵀ: XLA:CPU's fast dot for a step's few tokens)."
)
DETERMINISTIC_HELP = (
    "Greedy output bit-identical to plain decoding: every step runs the target at the full verify width, batch and "
    "context (slower; needs a drafter)."
)
