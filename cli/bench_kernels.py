"""`dflash-jax bench kernels`: dequant-matmul kernels vs their jnp reference (agreement and time)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from dflash_jax.cli._common import eprint, quiet_jax_logs, run_or_exit
from dflash_jax.errors import UserError

_SHAPES_HELP = "Comma-separated MxNxK (x[M,K] @ W[N,K].T); default: a small CPU set or a GPU set."
_BACKEND_HELP = "auto | pallas | interpret (auto: pallas on GPU, the Pallas interpreter elsewhere)."


def kernels(
    json_out: Annotated[Path | None, typer.Option("--json-out", help="Write results as JSON here.")] = None,
    shapes: Annotated[str | None, typer.Option("--shapes", help=_SHAPES_HELP)] = None,
    formats: Annotated[str, typer.Option("--formats", help="Comma-separated: fp8, nvfp4.")] = "fp8,nvfp4",
    backend: Annotated[str, typer.Option("--kernel-backend", help=_BACKEND_HELP)] = "auto",
    repeats: Annotated[int, typer.Option("--repeats", min=1, help="Timed samples (median reported).")] = 5,
    sweep: Annotated[bool, typer.Option("--sweep", help="Also time a set of tile configs.")] = False,
) -> None:
    """Time the FP8-row and NVFP4 Pallas kernels against their references; print a line per shape and tier."""
    quiet_jax_logs()

    def body() -> None:
        import jax

        from dflash_jax.kernels.bench import FORMATS, parse_shapes, run_kernel_bench

        try:
            shape_list = parse_shapes(shapes) if shapes else None
        except ValueError as e:
            raise UserError(str(e), param="--shapes") from None
        fmts = tuple(f.strip() for f in formats.split(",") if f.strip())
        if not fmts or any(f not in FORMATS for f in fmts):
            raise UserError(f"--formats must list some of {', '.join(FORMATS)}, got {formats!r}", param="--formats")
        b = backend.strip().lower()
        if b not in ("auto", "pallas", "interpret"):
            raise UserError(
                f"--kernel-backend must be auto, pallas or interpret, got {backend!r}",
                param="--kernel-backend",
            )
        if b == "auto":
            b = "pallas" if jax.default_backend() == "gpu" else "interpret"
        if b == "pallas" and jax.default_backend() != "gpu":
            raise UserError("--kernel-backend pallas needs a GPU; use interpret on CPU", param="--kernel-backend")
        result = run_kernel_bench(shape_list, formats=fmts, backend=b, repeats=repeats, sweep=sweep, log=eprint)
        if json_out is not None:
            json_out.parent.mkdir(parents=True, exist_ok=True)
            json_out.write_text(json.dumps(result, indent=2) + "\n")
            eprint(f"wrote {json_out}")

    run_or_exit(body)
