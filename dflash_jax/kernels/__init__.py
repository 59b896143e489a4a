"""Pallas dequant-matmul kernels (FP8-row, NVFP4), each with a jnp reference, tuning config and benchmark.

Import the kernels from their modules (`dflash_jax.kernels.fp8_matmul.fp8_matmul`,
`dflash_jax.kernels.nvfp4_matmul.nvfp4_matmul`); this package does not re-export them, so the module
names stay bound to the modules.
"""
