"""`dflash-jax serve` on a real checkpoint as a subprocess on a free port, for end-to-end server tests."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from dflash_jax.testing.server import free_port


class RealServer:
    """`with RealServer(model_dir, "--no-spec") as srv: srv.url`; the output goes to a log file (`srv.log()`)."""

    def __init__(self, model: Path, *extra: str, startup_timeout: float = 300.0):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.cmd = [
            sys.executable,
            "-m",
            "dflash_jax.cli.main",
            "serve",
            "--model",
            str(model),
            "--port",
            str(self.port),
            *extra,
        ]
        self.startup_timeout = startup_timeout
        self.proc: subprocess.Popen | None = None
        self._log = tempfile.NamedTemporaryFile(prefix="dflash-real-server-", suffix=".log", delete=False)

    def start(self) -> RealServer:
        env = dict(os.environ, XLA_FLAGS="", PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen(self.cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        self.stop()
        raise RuntimeError(f"server did not become healthy in {self.startup_timeout} s:\n{self.log()}")

    def log(self) -> str:
        with open(self._log.name, encoding="utf-8", errors="replace") as f:
            return f.read()

    def stop(self, timeout: float = 60.0) -> int | None:
        """SIGTERM, then wait; the exit status (None if it had to be killed)."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.terminate()
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
            return None

    def __enter__(self) -> RealServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
        try:
            os.unlink(self._log.name)
        except OSError:
            pass
