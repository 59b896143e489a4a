"""`dflash-jax serve` on a real checkpoint as a subprocess on a free port, for end-to-end server tests."""

from __future__ import annotations

import sys
from pathlib import Path

from dflash_jax.testing.server import ServerProcess, free_port
from dflash_jax.testing.waits import COMPILE_GUARD_S
from tests.xla_env import xla_flags


class RealServer(ServerProcess):
    """`with RealServer(model_dir, "--no-spec") as srv: srv.url`; the output goes to a log file (`srv.log()`).
    Without `warmup` the server starts with `--no-warmup` (its programs compile as its requests need them: fewer
    than the warm-up's, whose own tests are `test_serve_real` and the runner's). Start-up may compile: its guard is
    generous (seconds of an idle core, stretched by the load)."""

    def __init__(self, model: Path, *extra: str, startup_timeout: float = COMPILE_GUARD_S, warmup: bool = False):
        port = free_port()
        argv = [sys.executable, "-m", "dflash_jax.cli.main", "serve", "--model", str(model), "--port", str(port)]
        argv += [] if warmup else ["--no-warmup"]
        super().__init__(
            [*argv, *extra], port, env={"XLA_FLAGS": xla_flags()}, startup_timeout=startup_timeout, stop_timeout=60.0
        )
