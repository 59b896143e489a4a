"""Drafter weight quantization: formats (FP8-row, NVFP4), tiers, `linear()` dispatch, Pallas kernels,
memory estimate and quantized-checkpoint I/O. See speculation-control.md §4 and jax-practice.md §4."""

from dflash_jax.quant.formats import (
    E2M1_VALUES,
    FP8_MAX,
    NVFP4_BLOCK,
    Fp8RowWeight,
    Nvfp4Weight,
    QuantizedWeight,
    decode_e2m1,
    dequantize,
    encode_e2m1,
    is_quantized,
    nvfp4_folded_scales,
    nvfp4_global_scale,
    pack_nibbles,
    quantize,
    quantize_fp8_row,
    quantize_nvfp4,
    unpack_nibbles,
)
from dflash_jax.quant.io import load_quantized, read_quantized_config, save_quantized
from dflash_jax.quant.linear import BACKENDS, KERNEL_BACKEND_FLAGS, linear, resolve_kernel_backend
from dflash_jax.quant.memory import (
    SCRATCH_BYTES,
    MemoryEstimate,
    check_fits,
    device_memory,
    drafter_weight_bytes,
    estimate_drafter_memory,
    format_bytes,
    kv_cache_bytes,
    tensor_nbytes,
    tier_table,
    weight_bytes_by_tier,
    weight_nbytes,
)
from dflash_jax.quant.tiers import (
    DEFAULT_TIER,
    TIERS,
    covered_names,
    parse_tier,
    quantize_drafter_weights,
    tier_format,
)

__all__ = [
    "BACKENDS", "DEFAULT_TIER", "E2M1_VALUES", "FP8_MAX", "KERNEL_BACKEND_FLAGS", "NVFP4_BLOCK", "SCRATCH_BYTES",
    "TIERS", "Fp8RowWeight", "MemoryEstimate", "Nvfp4Weight", "QuantizedWeight", "check_fits", "covered_names",
    "decode_e2m1", "dequantize", "device_memory", "drafter_weight_bytes", "encode_e2m1",
    "estimate_drafter_memory", "format_bytes", "is_quantized", "kv_cache_bytes", "linear", "load_quantized",
    "nvfp4_folded_scales", "nvfp4_global_scale", "pack_nibbles", "parse_tier", "quantize",
    "quantize_drafter_weights", "quantize_fp8_row", "quantize_nvfp4", "read_quantized_config",
    "resolve_kernel_backend", "save_quantized", "tensor_nbytes", "tier_format", "tier_table", "unpack_nibbles",
    "weight_bytes_by_tier", "weight_nbytes",
]
