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
from collections.abc import Callable
from typing import Annotated

import typer

from dflash_jax.errors import UserError
from dflash_jax.server.config import ServeConfig
from dflash_jax.server.launch import serve
from dflash_jax.server.options import serve_command
from dflash_jax.testing.fake_runner import make_fake
from dflash_jax.testing.waits import GUARD_S, Patience, wait_exit

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


def _piped_output(proc: subprocess.Popen) -> str:
    out = proc.communicate()[0] if proc.stdout is not None else ""
    return out.decode(errors="replace") if isinstance(out, bytes) else out or ""


def wait_healthy(
    url: str,
    procs: list[subprocess.Popen],
    guard_s: float = GUARD_S,
    *,
    any_answer: bool = False,
    output: Callable[[subprocess.Popen], str] = _piped_output,
) -> float:
    """Wait until `url`/health answers 200 (any HTTP answer with `any_answer`) while every process of `procs` runs;
    the seconds waited. RuntimeError if one exits first (with the tail of its `output`) or the load-stretched
    `guard_s` is spent (the processes are left running)."""
    import httpx

    patience = Patience(guard_s)
    while not patience.spent():
        for p in procs:
            if p.poll() is not None:
                raise RuntimeError(f"server process exited with {p.returncode}:\n{output(p)[-4000:]}")
        try:
            r = httpx.get(url + "/health", timeout=5.0)
            if any_answer or r.status_code == 200:
                return patience.elapsed()
        except httpx.TransportError:
            pass
        time.sleep(0.05)
    raise RuntimeError(f"{url} did not become healthy in {patience.elapsed():.0f} s")


class ServerProcess:
    """A server command in a subprocess on `port`, its output in a temporary log file (`srv.log()`): `start()`
    waits for `/health` 200 (or only for the port with `wait_healthy=False`) or the process's exit, `stop()` sends
    SIGTERM and waits for the exit. `startup_timeout` and `stop_timeout` only guard against a hang: seconds of an
    idle core, stretched by the machine's load (`testing.waits`)."""

    def __init__(
        self,
        argv: list[str],
        port: int,
        *,
        env: dict[str, str] | None = None,
        wait_healthy: bool = True,
        startup_timeout: float = 120.0,
        stop_timeout: float = 60.0,
    ):
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.argv = argv
        self.env = env or {}
        self.wait_healthy = wait_healthy
        self.startup_timeout = startup_timeout
        self.stop_timeout = stop_timeout
        self.proc: subprocess.Popen | None = None
        self._log = tempfile.NamedTemporaryFile(prefix="dflash-server-", suffix=".log", delete=False)

    def start(self):
        env = dict(os.environ, PYTHONUNBUFFERED="1", **self.env)
        self.proc = subprocess.Popen(self.argv, stdout=self._log, stderr=subprocess.STDOUT, env=env)
        try:
            wait_healthy(
                self.url, [self.proc], self.startup_timeout, any_answer=not self.wait_healthy, output=lambda p: ""
            )
        except RuntimeError as e:
            self.kill()
            raise RuntimeError(f"{e}\n{self.log()}") from None
        return self

    def log(self) -> str:
        with open(self._log.name, encoding="utf-8", errors="replace") as f:
            return f.read()

    def terminate(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)

    def stop(self, timeout: float | None = None) -> int | None:
        """SIGTERM, then wait for the exit; the exit status (None if it had to be killed)."""
        if self.proc is None:
            return None
        self.terminate()
        try:
            return wait_exit(self.proc, self.stop_timeout if timeout is None else timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            return None

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
        try:
            os.unlink(self._log.name)
        except OSError:
            pass


class FakeServer(ServerProcess):
    """This module in a subprocess on a free port: `with FakeServer("--api-key", "k") as srv: srv.url`."""

    def __init__(self, *args: str, wait_healthy: bool = True, startup_timeout: float = 120.0):
        port = free_port()
        argv = [sys.executable, "-m", "dflash_jax.testing.server", "--fake", "--port", str(port), *args]
        super().__init__(argv, port, wait_healthy=wait_healthy, startup_timeout=startup_timeout)


if __name__ == "__main__":
    app()
