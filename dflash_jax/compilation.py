"""Compile cost as a reported budget: how many XLA programs this process compiled, and the seconds it spent.

Counts come from JAX's monitoring events (one backend-compile event per program handed to XLA, one cache-hit event
per program read back from the persistent compilation cache), so they cover every jitted function, ours or a
library's. `compile_counts()` is the process total since import; `CompileMeter` measures a stretch of work:

    with CompileMeter() as m:
        runner.warmup()
    print(m.summary())   # "14 programs compiled in 41.2 s (3 read from the cache), 25.0 s wall"

`Precompiler` compiles a planned set of programs ahead of their first call: the caller traces and lowers each one
(Python, one thread) while a pool of threads compiles those already lowered (XLA's compile of one program runs on
one core), and the caller then runs the compiled executables directly.

Compiled programs stay in memory while something holds their jitted function; builders of shared jitted functions
are memoized with `program_cache`, and `release_programs()` drops them all (every compiled executable maps code
pages, and a process that builds many distinct models, such as a test run, would otherwise hold all of them).
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import os
import threading
import time
from collections.abc import Callable, Hashable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

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
    wall_seconds: float = 0.0  # a `CompileMeter`'s stretch of wall time (compiles on several threads overlap)
    background: int = 0  # programs still compiling when the stretch ended (`Precompiler.finish(wait)`)

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
            "wall_s": round(self.wall_seconds, 3),
            "background_programs": self.background,
        }

    def summary(self) -> str:
        hits = f" ({self.cache_hits} read from the cache)" if self.cache_hits else ""
        wall = f", {self.wall_seconds:.1f} s wall" if self.wall_seconds else ""
        rest = f"; {self.background} more compiling in the background" if self.background else ""
        return f"{self.programs} programs compiled in {self.seconds:.1f} s{hits}{wall}{rest}"


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
        self._t0 = self._t1 = 0.0

    def __enter__(self) -> CompileMeter:
        self._start = compile_counts()
        self._end = None
        self._t0 = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        self._end = compile_counts()
        self._t1 = time.perf_counter()

    @property
    def counts(self) -> CompileCounts:
        end = self._end if self._end is not None else compile_counts()
        wall = (self._t1 if self._end is not None else time.perf_counter()) - self._t0
        return dataclasses.replace(end - self._start, wall_seconds=wall)

    def as_dict(self) -> dict[str, float | int]:
        return self.counts.as_dict()

    def summary(self) -> str:
        return self.counts.summary()


def compile_threads() -> int:
    """Programs compiled at once by a `Precompiler`: the CPUs this process may run on."""
    return max(1, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)


class Executable:
    """A program compiled ahead of its first call, and the shapes of its outputs. Made from a compile still under
    way, `compiled` waits for it (a step that needs a program compiling in the background waits for that one)."""

    def __init__(self, compiled: Any, out_info: Any):
        self._compiled = compiled  # jax.stages.Compiled, or a Future of one
        self.out_info = out_info  # the outputs' pytree of jax.ShapeDtypeStruct

    @property
    def ready(self) -> bool:
        return not isinstance(self._compiled, Future) or self._compiled.done()

    @property
    def compiled(self) -> Any:
        """The jax.stages.Compiled: called with the jitted function's arguments, static ones left out."""
        if isinstance(self._compiled, Future):
            self._compiled = self._compiled.result()
        return self._compiled


class Precompiler:
    """Compiles planned calls of jitted functions on `threads` threads (default `compile_threads()`).

    `plan(key, jitted, args, static)` traces and lowers the call in the caller's thread (once per key; keys already
    in `known` are skipped) and hands the lowered program to the pool, in the order planned; it returns the
    outputs' shapes so that a planning pass can go on without running anything. `finish(wait)` returns
    {key: Executable} once the compiles of the keys in `wait` (default: all) are done; the others go on in the
    background and their executables wait for them when first called. Use it as a context manager: leaving it
    lets the pool finish what was planned without waiting for it (with an exception: drops what has not started)."""

    def __init__(self, known: dict[Hashable, Executable] | None = None, threads: int | None = None):
        self.known = known if known is not None else {}
        self._pool = ThreadPoolExecutor(max_workers=threads or compile_threads(), thread_name_prefix="compile")
        self._pending: dict[Hashable, tuple[Future, Any]] = {}
        self._unwaited: list[Future] = []  # compiles `finish` handed on without waiting for them

    def plan(self, key: Hashable, jitted: Any, args: tuple, static: dict) -> Any:
        if key in self.known:
            return self.known[key].out_info
        if key not in self._pending:
            traced = jitted.trace(*args, **static)
            self._pending[key] = (self._pool.submit(traced.lower().compile), traced.out_info)
        return self._pending[key][1]

    @property
    def planned(self) -> tuple[Hashable, ...]:
        """The keys handed to the pool so far, in order."""
        return tuple(self._pending)

    def finish(self, wait: Callable[[Hashable], bool] | None = None) -> dict[Hashable, Executable]:
        out = {}
        for key, (fut, info) in self._pending.items():
            if wait is None or wait(key):
                out[key] = Executable(fut.result(), info)
            else:
                out[key] = Executable(fut, info)
                self._unwaited.append(fut)
        self._pending.clear()
        return out

    def __enter__(self) -> Precompiler:
        return self

    def __exit__(self, *exc: object) -> None:
        left = [fut for fut, _ in self._pending.values()] + self._unwaited
        self._pool.shutdown(wait=False, cancel_futures=exc[0] is not None)
        for fut in left:
            if not fut.done():
                _BACKGROUND.add(fut)
                fut.add_done_callback(_BACKGROUND.discard)


_BACKGROUND: set[Future] = set()  # compiles a Precompiler left running


def cancel_background_compiles() -> int:
    """Drop the background compiles that have not started (a shutting-down process would otherwise wait for all
    of them at exit; the ones compiling finish). Their executables can no longer run. Returns how many it dropped."""
    return sum(fut.cancel() for fut in list(_BACKGROUND))


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
