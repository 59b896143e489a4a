"""Multi-host serving: rank 0 schedules and serves HTTP; every other rank replays rank 0's device steps.

Every jitted step of `SpecRunner` (prefill, propose, verify; plain decoding is verify with no drafts) is a SPMD
program over the mesh of all processes' devices, so every process must launch the same steps, in the same order,
with the same shapes and inputs. Host-side scheduling (engine, controller, HTTP) runs on rank 0 only:

* rank 0 (`Leader`): `SpecRunner.plan_hook` broadcasts each step's `StepPlan` (step kind + the host numpy inputs
  + static arguments) and then launches the step, both under one lock, so the broadcasts and the steps reach
  the devices in one order; a keep-alive `noop` plan goes out when no step did for `keepalive_s` (an idle server
  must not leave the followers parked in one collective for hours); `shutdown()` sends the `shutdown` plan.
* ranks > 0 (`follow`): receive plans and `runner.apply_plan` them until `shutdown`. They never open a port.
* liveness: every follower's `Heartbeat` thread bumps a counter in the coordination service's key-value store
  every `HEARTBEAT_S`; rank 0's `FollowerWatch` reads them and reports a follower whose counter stood still for
  `LOST_AFTER_S` (or that never wrote one within `STARTUP_S`), so a dead follower is noticed within that bound
  even while rank 0's device thread waits in a collective for it.

Transport (`PlanChannel`): `jax.experimental.multihost_utils.broadcast_one_to_all`, a psum over every device of
every process. Each plan is one fixed-size frame (sequence number, byte length, and the plan itself when it
fits); a larger plan (a long prefill) follows in a second broadcast padded to a power of two, so only a few
shapes ever compile.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from dflash_jax.spec_decode.plan import NOOP, SHUTDOWN, StepPlan

log = logging.getLogger("dflash_jax.multihost")

FRAME_BYTES = 2048
_HEAD = 16  # u64 sequence number, u64 plan length
DEFAULT_KEEPALIVE_S = 30.0
HEARTBEAT_S = 1.0  # a follower writes its heartbeat this often
LOST_AFTER_S = 10.0  # rank 0 declares a follower lost after this long without a new heartbeat
STARTUP_S = 300.0  # ... or when its first heartbeat has not come this long after the watch started


def _broadcast(x: np.ndarray) -> np.ndarray:
    """Rank 0's `x` on every process (the same shape and dtype must be passed everywhere)."""
    import jax
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.broadcast_one_to_all(x, is_source=jax.process_index() == 0))


def _pow2(n: int) -> int:
    return 1 << max(int(n) - 1, 1).bit_length()


class PlanChannel:
    """Rank 0 -> every rank, over the devices. `broadcast` is injectable (tests use an in-process queue)."""

    def __init__(self, broadcast: Callable[[np.ndarray], np.ndarray] = _broadcast):
        self._broadcast = broadcast
        self._seq = 0

    def send(self, plan: StepPlan) -> None:
        data = plan.encode()
        frame = np.zeros(FRAME_BYTES, np.uint8)
        frame[:_HEAD] = np.frombuffer(np.asarray([self._seq, len(data)], "<u8").tobytes(), np.uint8)
        inline = len(data) <= FRAME_BYTES - _HEAD
        if inline:
            frame[_HEAD : _HEAD + len(data)] = np.frombuffer(data, np.uint8)
        self._broadcast(frame)
        if not inline:
            body = np.zeros(_pow2(len(data)), np.uint8)
            body[: len(data)] = np.frombuffer(data, np.uint8)
            self._broadcast(body)
        self._seq += 1

    def recv(self) -> StepPlan:
        frame = self._broadcast(np.zeros(FRAME_BYTES, np.uint8))
        seq, n = (int(v) for v in np.frombuffer(frame[:_HEAD].tobytes(), "<u8"))
        if seq != self._seq:
            raise RuntimeError(f"multi-host step plans out of order: got #{seq}, expected #{self._seq}")
        if n <= FRAME_BYTES - _HEAD:
            data = frame[_HEAD : _HEAD + n]
        else:
            data = self._broadcast(np.zeros(_pow2(n), np.uint8))[:n]
        self._seq += 1
        return StepPlan.decode(data.tobytes())


class Leader:
    """Rank 0's side: `attach(runner)` makes every jitted step of the runner broadcast its plan first."""

    def __init__(self, channel: PlanChannel | None = None, *, keepalive_s: float | None = DEFAULT_KEEPALIVE_S):
        self.channel = channel or PlanChannel()
        self.keepalive_s = keepalive_s
        self.steps = 0
        self._lock = threading.Lock()
        self._closed = False
        self._last = time.monotonic()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def attach(self, runner: Any) -> Leader:
        runner.plan_hook = self.run
        if self.keepalive_s and self._thread is None:
            self._thread = threading.Thread(target=self._keepalive, name="dflash-multihost-keepalive", daemon=True)
            self._thread.start()
        return self

    def run(self, plan: StepPlan, apply: Callable[[StepPlan], Any]) -> Any:
        """The runner's `plan_hook`: broadcast `plan`, then launch the step (one lock around both)."""
        with self._lock:
            if self._closed:
                raise RuntimeError("multi-host: the followers were shut down; no more device steps can run")
            self.channel.send(plan)
            self._last = time.monotonic()
            self.steps += 1
            return apply(plan)

    def shutdown(self) -> None:
        """Tell the followers to leave their loop (idempotent). Steps launched afterwards raise."""
        self._stop.set()
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self.channel.send(StepPlan(SHUTDOWN))
        log.info("multi-host: followers told to shut down after %d steps", self.steps)

    def _keepalive(self) -> None:
        assert self.keepalive_s
        while not self._stop.wait(min(1.0, self.keepalive_s)):
            with self._lock:
                if not self._closed and time.monotonic() - self._last >= self.keepalive_s:
                    self.channel.send(StepPlan(NOOP))
                    self._last = time.monotonic()


def follow(runner: Any, channel: PlanChannel | None = None) -> int:
    """Ranks > 0: apply rank 0's step plans to `runner` until the shutdown plan. Returns the number of steps."""
    channel = channel or PlanChannel()
    n = 0
    while True:
        plan = channel.recv()
        if plan.kind == SHUTDOWN:
            log.info("multi-host follower: shutdown after %d steps", n)
            return n
        if plan.kind == NOOP:
            continue
        runner.apply_plan(plan)
        n += 1


def heartbeat_key(rank: int) -> str:
    return f"dflash_jax/heartbeat/{rank}"


def _kv_client() -> Any:
    """The coordination service's client of this process (set by `jax.distributed.initialize`)."""
    from jax._src import distributed

    client = distributed.global_state.client
    if client is None:
        raise RuntimeError("multi-host liveness needs jax.distributed.initialize first")
    return client


class Heartbeat:
    """Ranks > 0: a daemon thread that bumps `heartbeat_key(rank)` in the key-value store every `interval_s`."""

    def __init__(self, rank: int, client: Any = None, *, interval_s: float = HEARTBEAT_S):
        self.rank = rank
        self.client = client
        self.interval_s = interval_s
        self.beats = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="dflash-multihost-heartbeat", daemon=True)

    def start(self) -> Heartbeat:
        if self.client is None:
            self.client = _kv_client()
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while True:
            self.beats += 1
            try:
                self.client.key_value_set(heartbeat_key(self.rank), str(self.beats), allow_overwrite=True)
            except Exception as e:  # noqa: BLE001 - the coordinator is gone: rank 0 is down, nothing to tell
                log.warning("multi-host follower %d: heartbeat failed (%s)", self.rank, e)
            if self._stop.wait(self.interval_s):
                return


class FollowerWatch:
    """Rank 0: a daemon thread that reads every follower's heartbeat and calls `on_lost(rank, silent_s)` (once,
    for the first follower found lost) when one stood still for `lost_after_s`, or never came `startup_s` after
    `start()`."""

    def __init__(
        self,
        ranks: list[int],
        on_lost: Callable[[int, float], None],
        client: Any = None,
        *,
        interval_s: float = HEARTBEAT_S,
        lost_after_s: float = LOST_AFTER_S,
        startup_s: float = STARTUP_S,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.ranks = list(ranks)
        self.on_lost = on_lost
        self.client = client
        self.interval_s = interval_s
        self.lost_after_s = lost_after_s
        self.startup_s = startup_s
        self.clock = clock
        self.lost: int | None = None
        self._last: dict[int, str | None] = {}
        self._since: dict[int, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="dflash-multihost-watch", daemon=True)

    def begin(self) -> FollowerWatch:
        """Start the clocks (the startup bound counts from here); `check()` may be called from now on."""
        if self.client is None:
            self.client = _kv_client()
        now = self.clock()
        self._last = {r: None for r in self.ranks}
        self._since = {r: now for r in self.ranks}
        return self

    def start(self) -> FollowerWatch:
        """`begin()` and check every `interval_s` on a daemon thread."""
        self.begin()
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def check(self) -> int | None:
        """One pass over the followers: the rank of a lost one (and `on_lost` called), else None."""
        now = self.clock()
        for r in self.ranks:
            try:
                value = self.client.key_value_try_get(heartbeat_key(r))
            except Exception:  # noqa: BLE001 - not written yet (NotFound)
                value = None
            if value is not None and value != self._last[r]:
                self._last[r], self._since[r] = value, now
                continue
            bound = self.lost_after_s if self._last[r] is not None else self.startup_s
            if now - self._since[r] >= bound:
                self.lost = r
                self.on_lost(r, now - self._since[r])
                return r
        return None

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            if self.check() is not None:
                return
