"""Compile cost as a reported budget: how many XLA programs this process compiled, and the seconds it spent.

Counts come from JAX's monitoring events (one backend-compile event per program handed to XLA, one cache-hit event
per program read back from the persistent compilation cache), so they cover every jitted function, ours or a
library's. `compile_counts()` is the process total since import; `CompileMeter` measures a stretch of work:

    with CompileMeter() as m:
        runner.warmup()
    print(m.summary())   # "14 programs compiled in 41.2 s (3 read from the cache)"

Compiled programs stay in memory while something holds their jitted function; builders of shared jitted functions
are memoized with `program_cache`, and `release_programs()` drops them all (every compiled executable maps code
pages, and a process that builds many distinct models, such as a test run, would otherwise hold all of them).
"""

from __future__ import annotations

import functools
import gc
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import jax
from jax import monitoring

_F = TypeVar("_F", bound=Callable)

BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
TRACE_EVENT = "/jax/core/compile/jaxpr_trace_duration"
LOWER_EVENT = "/jax/core/compile/jaxpr_to_mlir_module_duration"
CACHE_HIT_EVENT = "/jax/compilation_cache/cache_hits"


@dataclass(frozen=True)
class CompileCounts:
    """Totals of one process or one measured stretch. `programs` were compiled by XLA (cache hits excluded);
    `seconds` is the backend time of every program, the cache reads included; tracing and lowering to MLIR are
    `trace_seconds`."""

    programs: int = 0
    seconds: float = 0.0
    cache_hits: int = 0
    trace_seconds: float = 0.0

    def __sub__(self, other: CompileCounts) -> CompileCounts:
        return CompileCounts(
            self.programs - other.programs,
            self.seconds - other.seconds,
            self.cache_hits - other.cache_hits,
            self.trace_seconds - other.trace_seconds,
        )

    def as_dict(self) -> dict[str, float | int]:
        return {
            "programs_compiled": self.programs,
            "compile_s": round(self.seconds, 3),
            "cache_hits": self.cache_hits,
            "trace_s": round(self.trace_seconds, 3),
        }

    def summary(self) -> str:
        hits = f" ({self.cache_hits} read from the cache)" if self.cache_hits else ""
        return f"{self.programs} programs compiled in {self.seconds:.1f} s{hits}"


class _Tally:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.backend_events = 0
        self.seconds = 0.0
        self.hits = 0
        self.trace_seconds = 0.0

    def on_duration(self, event: str, duration: float, **_: object) -> None:
        if event == BACKEND_COMPILE_EVENT:
            with self.lock:
                self.backend_events += 1
                self.seconds += duration
        elif event in (TRACE_EVENT, LOWER_EVENT):
            with self.lock:
                self.trace_seconds += duration

    def on_event(self, event: str, **_: object) -> None:
        if event == CACHE_HIT_EVENT:
            with self.lock:
                self.hits += 1

    def counts(self) -> CompileCounts:
        with self.lock:
            return CompileCounts(self.backend_events - self.hits, self.seconds, self.hits, self.trace_seconds)


_TALLY = _Tally()
monitoring.register_event_duration_secs_listener(_TALLY.on_duration)
monitoring.register_event_listener(_TALLY.on_event)


def compile_counts() -> CompileCounts:
    """This process's totals since `dflash_jax.compilation` was first imported."""
    return _TALLY.counts()


class CompileMeter:
    """Context manager: the compile counts of the work inside it (other threads' compiles included)."""

    def __init__(self) -> None:
        self._start = CompileCounts()
        self._end: CompileCounts | None = None

    def __enter__(self) -> CompileMeter:
        self._start = compile_counts()
        self._end = None
        return self

    def __exit__(self, *exc: object) -> None:
        self._end = compile_counts()

    @property
    def counts(self) -> CompileCounts:
        return (self._end if self._end is not None else compile_counts()) - self._start

    def as_dict(self) -> dict[str, float | int]:
        return self.counts.as_dict()

    def summary(self) -> str:
        return self.counts.summary()


_PROGRAM_CACHES: list = []


def program_cache(maxsize: int) -> Callable[[_F], _F]:
    """`functools.lru_cache(maxsize)` for a builder of jitted functions, registered with `release_programs`."""

    def wrap(fn: _F) -> _F:
        cached = functools.lru_cache(maxsize=maxsize)(fn)
        _PROGRAM_CACHES.append(cached)
        return cached  # type: ignore[return-value]

    return wrap


def release_programs() -> None:
    """Drop every memoized program builder and JAX's own caches, so the executables nothing else holds are freed."""
    for cached in _PROGRAM_CACHES:
        cached.cache_clear()
    jax.clear_caches()
    gc.collect()
