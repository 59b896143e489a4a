"""`dflash-jax serve` on a real checkpoint as a subprocess on a free port, for end-to-end server tests."""

from __future__ import annotations

import sys
from pathlib import Path

from dflash_jax.testing.server import ServerProcess, free_port


class RealServer(ServerProcess):
    """`with RealServer(model_dir, "--no-spec") as srv: srv.url`; the output goes to a log file (`srv.log()`)."""

    def __init__(self, model: Path, *extra: str, startup_timeout: float = 300.0):
        port = free_port()
        argv = [sys.executable, "-m", "dflash_jax.cli.main", "serve", "--model", str(model), "--port", str(port)]
        super().__init__(
            [*argv, *extra], port, env={"XLA_FLAGS": ""}, startup_timeout=startup_timeout, stop_timeout=60.0
        )
