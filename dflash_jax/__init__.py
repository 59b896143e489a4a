"""dflash-jax: LLM inference on JAX/XLA with DFlash block-diffusion speculative decoding."""

__version__ = "0.1.0"
