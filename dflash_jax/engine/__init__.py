"""Host-side engine: continuous batching over a `StepRunner` (interface.py), stops, detokenization, streaming.

Usage: `engine = Engine(runner, tokenizer, max_num_seqs=8, max_queued_requests=64, controller=None)`,
`await engine.start(warmup=None)`, then `stream = engine.submit(GenerationRequest(prompt_ids, max_tokens=64))`
and `async for out in stream` (or `await stream.collect()`), all on one asyncio event loop.

From synchronous code: `OfflineEngine(runner, tokenizer, ...).generate(prompts, sampling, max_tokens=...)`
(offline.py) runs the same engine to completion and returns one output per prompt.
"""

from dflash_jax.engine.engine import Engine, RequestStream, check_context_length
from dflash_jax.engine.interface import SamplingParams, StepResult, StepRunner
from dflash_jax.engine.offline import OfflineEngine, RunStats
from dflash_jax.engine.types import (
    ContextLengthError,
    DraftController,
    EngineObserver,
    EngineUnavailableError,
    GenerationRequest,
    QueueFullError,
    RequestOutput,
    RequestRecord,
    SpecStats,
    TokenizerLike,
)

__all__ = [
    "ContextLengthError",
    "DraftController",
    "Engine",
    "EngineObserver",
    "EngineUnavailableError",
    "GenerationRequest",
    "OfflineEngine",
    "QueueFullError",
    "RequestOutput",
    "RequestRecord",
    "RequestStream",
    "RunStats",
    "SamplingParams",
    "SpecStats",
    "StepResult",
    "StepRunner",
    "TokenizerLike",
    "check_context_length",
]
