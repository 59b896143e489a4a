"""Serve the app with uvicorn, with a graceful drain on SIGTERM/SIGINT.

First signal: stop admitting (new requests and /health get 503), let running and queued requests finish for
up to `--shutdown-timeout` seconds, abort whatever is left, then stop uvicorn; the process exits 0.
A second signal forces an immediate exit.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable, Generator

import uvicorn
from fastapi import FastAPI

from dflash_jax.engine.engine import Engine
from dflash_jax.engine.interface import StepRunner
from dflash_jax.engine.types import DraftController, TokenizerLike
from dflash_jax.server.app import create_app
from dflash_jax.server.config import ServeConfig

log = logging.getLogger("dflash_jax.server")

EXIT_LOST_PROCESS = 3  # exit status of rank 0 when a multi-host follower was lost
LOST_EXIT_GRACE_S = 2.0  # seconds for the error answers to reach the clients before that exit


class DrainingServer(uvicorn.Server):
    """uvicorn.Server whose first SIGTERM/SIGINT drains the engine before shutting down."""

    def __init__(self, config: uvicorn.Config, engine: Engine, shutdown_timeout: float):
        super().__init__(config)
        self.engine = engine
        self.shutdown_timeout = shutdown_timeout
        self._signals = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain_task: asyncio.Task | None = None

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        # Unlike uvicorn's own handler this does not re-raise the signal afterwards: a drained shutdown
        # exits with status 0.
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        self._loop = asyncio.get_running_loop()
        sigs = (signal.SIGINT, signal.SIGTERM)
        previous = {s: signal.signal(s, self._on_signal) for s in sigs}
        try:
            yield
        finally:
            for s, h in previous.items():
                signal.signal(s, h)

    def _on_signal(self, sig: int, frame: object) -> None:
        self._signals += 1
        if self._signals > 1 or not self.started or self._loop is None:
            log.warning("signal %d: exiting now", sig)
            self.force_exit = self._signals > 1
            self.should_exit = True
            return
        self._loop.call_soon_threadsafe(self._start_drain)

    def _start_drain(self) -> None:
        self._drain_task = asyncio.ensure_future(self.drain())

    async def drain(self) -> None:
        eng = self.engine
        log.info(
            "shutting down: draining %d running and %d queued requests (up to %.1f s)",
            eng.num_running,
            eng.num_waiting,
            self.shutdown_timeout,
        )
        eng.begin_drain()
        if not await eng.wait_idle(self.shutdown_timeout):
            log.warning("shutdown timeout: aborting %d requests", eng.num_running + eng.num_waiting)
            eng.abort_all()
            await eng.wait_idle(5.0)
        await asyncio.sleep(0.1)  # let the streams write their last events
        self.should_exit = True


def run_server(app: FastAPI, config: ServeConfig) -> int:
    """Serve `app` (from `create_app`) on `config.host:config.port` until drained by a signal. Returns 0."""
    config.check_bind()
    uv_config = uvicorn.Config(
        app,
        host=config.host,
        port=config.port,
        log_level=config.log_level,
        lifespan="on",
        timeout_graceful_shutdown=5,
        access_log=config.log_level == "debug",
    )
    server = DrainingServer(uv_config, app.state.engine, config.shutdown_timeout)
    server.run()
    return 0


def serve(
    config: ServeConfig,
    runner: StepRunner,
    tokenizer: TokenizerLike,
    *,
    model_name: str | None = None,
    controller: DraftController | None = None,
    warmup: Callable[[], object] | None = None,
    memory_budget: dict[str, object] | None = None,
    on_app: Callable[[FastAPI], object] | None = None,
) -> int:
    """Build the app and serve it (blocking); logs the resolved config (and the memory budget, if given).
    `on_app` sees the app before it serves."""
    config.check_bind()
    setup_logging(config.log_level)
    log.info("serve config: %s", json.dumps(config.summary(), default=str))
    if memory_budget:
        log.info("memory budget: %s", json.dumps(memory_budget, default=str))
    app = create_app(runner, tokenizer, config, model_name=model_name, controller=controller, warmup=warmup)
    if on_app is not None:
        on_app(app)
    return run_server(app, config)


def serve_or_follow(
    config: ServeConfig,
    runner: StepRunner,
    tokenizer: TokenizerLike,
    *,
    model_name: str | None = None,
    controller: DraftController | None = None,
    warmup: Callable[[], object] | None = None,
    memory_budget: dict[str, object] | None = None,
    keepalive_s: float | None = None,
) -> int:
    """`serve` for one process. Under multi-host (`jax.process_count() > 1`, after `jax.distributed.initialize`)
    process 0 serves HTTP and schedules, broadcasting every device step to the others
    (`spec_decode.multihost.Leader`); every other process replays those steps on its own runner
    (`spec_decode.multihost.follow`) and never opens a port. When process 0 stops serving (drained by a signal,
    or failed) it tells the followers to stop; then every process leaves `jax.distributed` together.

    A follower that dies is noticed by process 0 within `multihost.LOST_AFTER_S` (+ one heartbeat): the engine
    is failed (in-flight requests get an error, /health 503) and, `LOST_EXIT_GRACE_S` later, process 0 exits
    with status `EXIT_LOST_PROCESS` and a message naming the lost process."""
    import jax

    if jax.process_count() == 1:
        return serve(
            config,
            runner,
            tokenizer,
            model_name=model_name,
            controller=controller,
            warmup=warmup,
            memory_budget=memory_budget,
        )
    # JAX (and the multi-host channel) only for multi-host serving: the fake-runner server stays JAX-free
    from dflash_jax.spec_decode.multihost import DEFAULT_KEEPALIVE_S, FollowerWatch, Heartbeat, Leader, follow

    setup_logging(config.log_level)
    rank, world = jax.process_index(), jax.process_count()
    try:
        if rank == 0:
            leader = Leader(keepalive_s=DEFAULT_KEEPALIVE_S if keepalive_s is None else keepalive_s).attach(runner)
            apps: list[FastAPI] = []
            watch = FollowerWatch(list(range(1, world)), lambda r, s: _lost_follower(r, world, s, apps)).start()
            log.info(
                "multi-host: process 0 of %d serves HTTP; %d follower(s), %d devices",
                world,
                world - 1,
                jax.device_count(),
            )
            try:
                return serve(
                    config,
                    runner,
                    tokenizer,
                    model_name=model_name,
                    controller=controller,
                    warmup=warmup,
                    memory_budget=memory_budget,
                    on_app=apps.append,
                )
            finally:
                watch.stop()
                leader.shutdown()
        log.info("multi-host: process %d of %d follows process 0's device steps (no HTTP)", rank, world)
        beat = Heartbeat(rank).start()
        try:
            steps = follow(runner)
        finally:
            beat.stop()
        log.info("multi-host: process %d replayed %d steps; exiting", rank, steps)
        return 0
    finally:
        jax.distributed.shutdown()


def _lost_follower(rank: int, world: int, silent_s: float, apps: list[FastAPI]) -> None:
    """Process 0, on the watch thread: fail the engine now, exit non-zero after a short grace (a device call may
    wait for the lost process forever, so the exit does not wait for it)."""
    msg = f"multi-host: lost process {rank} of {world} (no heartbeat for {silent_s:.1f} s)"
    log.error("%s; failing the in-flight requests, exiting with status %d", msg, EXIT_LOST_PROCESS)
    for app in apps:
        app.state.engine.fail(msg)

    def leave() -> None:
        print(f"error: {msg}", file=sys.stderr, flush=True)
        logging.shutdown()
        os._exit(EXIT_LOST_PROCESS)

    threading.Timer(LOST_EXIT_GRACE_S, leave).start()


def enable_compilation_cache(path: str | None) -> None:
    """Turn on JAX's persistent compilation cache (`--compilation-cache-dir`); call it before anything is
    jitted (before loading the model), so warm-up after a restart reads compiled executables from disk."""
    if not path:
        return
    import os

    import jax

    os.makedirs(path, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    log.info("JAX persistent compilation cache: %s", path)


def setup_logging(level: str) -> None:
    root = logging.getLogger("dflash_jax")
    if not root.handlers:
        h = logging.StreamHandler()
        h.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        root.addHandler(h)
    root.setLevel(level.upper())
