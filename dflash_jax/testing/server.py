"""Serve the fake runner + tiny tokenizer through the real server and launcher (for tests and demos).

    python -m dflash_jax.testing.server --fake --port 8123 [serve flags...] [--gamma 4 --acceptance 0.7
        --step-delay 0.002 --warmup-seconds 0 --fail-after-steps N]

The options other than the fake-runner ones are `dflash-jax serve` flags (`--max-num-seqs`, `--api-key`,
`--shutdown-timeout`, ..., and their `DFLASH_JAX_*` variables), parsed by the same typer command, so this
exercises the same config, app and signal handling as the real command.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from typing import Annotated

import typer

from dflash_jax.errors import UserError
from dflash_jax.server.config import ServeConfig
from dflash_jax.server.launch import serve
from dflash_jax.server.options import serve_command
from dflash_jax.testing.fake_runner import make_fake

app = typer.Typer(add_completion=False, pretty_exceptions_enable=False)


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def main(
    ctx: typer.Context,
    fake: Annotated[bool, typer.Option("--fake", help="serve the deterministic fake runner (the only mode)")] = False,
    gamma: Annotated[int, typer.Option(help="fake verify width (1 = no speculation)")] = 4,
    acceptance: Annotated[float, typer.Option(help="fake per-position acceptance probability")] = 0.7,
    step_delay: Annotated[float, typer.Option(help="seconds of fake device time per step")] = 0.0,
    warmup_seconds: Annotated[float, typer.Option(help="fake warm-up duration")] = 0.0,
    fail_after_steps: Annotated[int | None, typer.Option(help="raise on this runner step")] = None,
) -> None:
    """The fake-runner options; every other option is a `dflash-jax serve` flag."""

    def start(config: ServeConfig) -> int:
        runner, tok = make_fake(
            max_slots=config.max_num_seqs,
            max_model_len=config.max_model_len or 2048,
            gamma=1 if config.no_spec else gamma,
            acceptance=acceptance,
            step_delay=step_delay,
            fail_after_steps=fail_after_steps,
            record=False,
        )
        warmup = (lambda: time.sleep(warmup_seconds)) if warmup_seconds > 0 else None
        try:
            return serve(config, runner, tok, model_name=config.served_model_name or "fake-model", warmup=warmup)
        except UserError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2

    serve_app = typer.Typer(add_completion=False, pretty_exceptions_enable=False)
    serve_app.command()(serve_command(start))
    typer.main.get_command(serve_app).main(args=ctx.args, prog_name="python -m dflash_jax.testing.server")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class FakeServer:
    """This module in a subprocess on a free port: `with FakeServer("--api-key", "k") as srv: srv.url`.

    The server's output goes to a temporary log file (`srv.log()`); `stop()` sends SIGTERM and waits.
    """

    def __init__(self, *args: str, wait_healthy: bool = True, startup_timeout: float = 60.0):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.args = ["--fake", "--port", str(self.port), *args]
        self.wait_healthy = wait_healthy
        self.startup_timeout = startup_timeout
        self.proc: subprocess.Popen | None = None
        self._log = tempfile.NamedTemporaryFile(prefix="dflash-fake-server-", suffix=".log", delete=False)

    def start(self) -> FakeServer:
        import httpx

        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "dflash_jax.testing.server", *self.args],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=env,
        )
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"fake server exited with {self.proc.returncode}:\n{self.log()}")
            try:
                r = httpx.get(self.url + "/health", timeout=1.0)
                if not self.wait_healthy or r.status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.05)
        self.kill()
        raise RuntimeError(f"fake server did not come up in {self.startup_timeout} s:\n{self.log()}")

    def log(self) -> str:
        with open(self._log.name, encoding="utf-8", errors="replace") as f:
            return f.read()

    def terminate(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)

    def stop(self, timeout: float = 30.0) -> int | None:
        if self.proc is None:
            return None
        self.terminate()
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            return None

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def __enter__(self) -> FakeServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
        try:
            os.unlink(self._log.name)
        except OSError:
            pass


if __name__ == "__main__":
    app()
