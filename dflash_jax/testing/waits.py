"""Waiting for an event in tests and test servers, on a machine that may be busy.

A wait ends when its event happens (a predicate turns true, a process exits). Its ceiling only guards against a
hang: it counts seconds of an idle core, and is stretched by the machine's load (runnable processes per core
over the last minute, read at every check), so a machine running other work gives a slow event the time it
needs instead of failing it.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import time
from collections.abc import Callable

GUARD_S = 120.0  # default ceiling, seconds of an idle core: an event in a test takes a few at most
COMPILE_GUARD_S = 600.0  # the ceiling of a wait that includes compiling a model's programs (a real server's start)


def load_factor() -> float:
    """Runnable processes per core over the last minute, at least 1 (1 where the platform has no load average)."""
    try:
        load = os.getloadavg()[0]
    except (AttributeError, OSError):
        return 1.0
    return max(1.0, load / (os.cpu_count() or 1))


def stretched(seconds: float) -> float:
    """`seconds` of an idle core at the machine's current load: a fixed timeout (an HTTP client's) that only guards
    against a hang."""
    return seconds * load_factor()


class Patience:
    """A ceiling of `seconds` on an idle core, stretched by the load: `while not p.spent(): ...`."""

    def __init__(self, seconds: float = GUARD_S):
        self.seconds = seconds
        self.start = time.monotonic()

    def elapsed(self) -> float:
        return time.monotonic() - self.start

    def spent(self) -> bool:
        return self.elapsed() > self.seconds * load_factor()

    def left(self) -> float:
        """Seconds left at the current load (at least 0)."""
        return max(0.0, self.seconds * load_factor() - self.elapsed())


def wait_until(pred: Callable[[], object], guard_s: float = GUARD_S, interval: float = 0.02) -> bool:
    """Poll `pred` until it is true (returns True) or the load-stretched `guard_s` is spent (returns its last
    answer)."""
    patience = Patience(guard_s)
    while not patience.spent():
        if pred():
            return True
        time.sleep(interval)
    return bool(pred())


async def wait_until_async(pred: Callable[[], object], guard_s: float = GUARD_S, interval: float = 0.001) -> bool:
    """`wait_until` for a coroutine: polls `pred` between `asyncio.sleep(interval)`s, so the event loop runs."""
    patience = Patience(guard_s)
    while not patience.spent():
        if pred():
            return True
        await asyncio.sleep(interval)
    return bool(pred())


def _until_exit(call, guard_s: float):
    """`call(timeout=...)` (a Popen's `wait` or `communicate`) in slices of at most 1 s until it returns; its
    `subprocess.TimeoutExpired` once the load-stretched `guard_s` is spent."""
    patience = Patience(guard_s)
    while True:
        try:
            return call(timeout=max(0.1, min(1.0, patience.left())))
        except subprocess.TimeoutExpired:
            if patience.spent():
                raise


def wait_exit(proc: subprocess.Popen, guard_s: float = GUARD_S) -> int:
    """The exit status of `proc` once it exits; `subprocess.TimeoutExpired` if the load-stretched `guard_s` is spent
    first (the process is left running)."""
    return _until_exit(proc.wait, guard_s)


def communicate(proc: subprocess.Popen, guard_s: float = GUARD_S) -> tuple:
    """`proc.communicate()` (its piped output, read to the end) once it exits; `subprocess.TimeoutExpired` if the
    load-stretched `guard_s` is spent first (the process is left running)."""
    return _until_exit(proc.communicate, guard_s)


def run(cmd: list[str], guard_s: float = GUARD_S, **kwargs) -> subprocess.CompletedProcess:
    """`subprocess.run(cmd, capture_output=True, text=True, **kwargs)` whose ceiling is the load-stretched
    `guard_s` (the process is killed and `subprocess.TimeoutExpired` raised once it is spent)."""
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kwargs) as proc:
        try:
            out, err = communicate(proc, guard_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
            raise
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)
