"""The kernels' one backend vocabulary: `xla | pallas | interpret`.

* `xla`: plain jnp, compiled by XLA on any device (the CPU default).
* `pallas`: the Pallas kernel, lowered through Triton on a GPU.
* `interpret`: the same Pallas kernel run by the Pallas interpreter (any device; CPU tests, correct but slow).

A flag (`--kernel-backend`, `--attention-backend`: `auto|xla|pallas`) becomes one of these in
`resolve_backend`, the only place that chooses interpret mode: `pallas` off a GPU runs interpreted.
"""

from __future__ import annotations

import jax

from dflash_jax.errors import UserError

BACKENDS = ("xla", "pallas", "interpret")
KERNEL_BACKEND_FLAGS = ("auto", "xla", "pallas")  # --kernel-backend (the quantized matmuls)
ATTENTION_BACKEND_FLAGS = ("auto", "xla", "pallas")  # --attention-backend (the attention over the KV pages)


def on_gpu(platform: str | None = None) -> bool:
    """Whether `platform` (default: `jax.default_backend()`) is a GPU, where Pallas lowers through Triton."""
    return (platform or jax.default_backend()).lower() in ("gpu", "cuda", "rocm")


def resolve_backend(flag: str, *, choices: tuple[str, ...], param: str, platform: str | None = None) -> str:
    """The backend for flag value `flag` (one of `choices`, a subset of `auto | xla | pallas`; `param` names the
    flag in the error): `auto` = `pallas` on a GPU, else `xla`; `pallas` off a GPU = `interpret`."""
    value = (flag or "").strip().lower()
    if value not in choices:
        raise UserError(f"{param} must be one of {', '.join(choices)}, got {flag!r}", param=param)
    gpu = on_gpu(platform)
    if value == "xla" or (value == "auto" and not gpu):
        return "xla"
    return "pallas" if gpu else "interpret"


def attention_backend_for(flag: str, tp_size: int = 1, platform: str | None = None) -> str:
    """`--attention-backend` resolved for a target split over `tp_size` devices: as `resolve_backend`, except that
    `auto` keeps `xla` under target TP (the kernel has no partitioning rule, so GSPMD would gather every rank's
    heads to one call)."""
    backend = resolve_backend(flag, choices=ATTENTION_BACKEND_FLAGS, param="--attention-backend", platform=platform)
    return "xla" if tp_size > 1 and flag.strip().lower() == "auto" else backend


def check_backend(backend: str, what: str) -> None:
    """ValueError unless `backend` is one of `BACKENDS` (`what` names the caller)."""
    if backend not in BACKENDS:
        raise ValueError(f"{what}: backend must be one of {BACKENDS}, got {backend!r}")
