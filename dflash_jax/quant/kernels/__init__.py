"""Pallas dequant-matmul kernels (FP8-row, NVFP4), each with a jnp reference, tuning config and benchmark."""

from dflash_jax.quant.kernels.fp8_matmul import Fp8MatmulConfig, fp8_matmul, fp8_matmul_reference
from dflash_jax.quant.kernels.nvfp4_matmul import Nvfp4MatmulConfig, nvfp4_matmul, nvfp4_matmul_reference

__all__ = [
    "Fp8MatmulConfig", "Nvfp4MatmulConfig", "fp8_matmul", "fp8_matmul_reference", "nvfp4_matmul",
    "nvfp4_matmul_reference",
]
