"""Lowering a jitted function for CUDA on a machine without a GPU (the Pallas->Triton lowering rules run on CPU).

Some jax versions read the target GPU from the current abstract mesh when no GPU is attached (and refuse to lower
without one); older ones fall back to compute capability 9.0. Both are given the same target here: an H200
(sm_90), the GPU the kit runs on. On a machine with that GPU the abstract device matches the local one.
"""

from __future__ import annotations

import contextlib

import jax
from jax import export

TRITON_CALL = "__gpu$xla.gpu.triton"
TARGET_KIND = "NVIDIA H200"


def cuda_target():
    """A context in which lowering for CUDA targets an H200, whether or not a GPU is attached."""
    abstract_device = getattr(jax.sharding, "AbstractDevice", None)
    if abstract_device is None:
        return contextlib.nullcontext()
    device = abstract_device(device_kind=TARGET_KIND, num_cores=None, platform="gpu")
    return jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), (), abstract_device=device))


def export_for_cuda(fn, *args) -> str:
    """The StableHLO text of `jax.jit(fn)(*args)` exported for CUDA (the Triton custom call's check disabled)."""
    no_check = [export.DisabledSafetyCheck.custom_call(TRITON_CALL)]
    with cuda_target():
        return export.export(jax.jit(fn), platforms=["cuda"], disabled_checks=no_check)(*args).mlir_module()
