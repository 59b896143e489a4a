"""`ServeConfig`: every `dflash-jax serve` flag in one frozen dataclass, validated once.

Building it from flags, `DFLASH_JAX_*` environment variables and `--speculative-config` JSON is
`dflash_jax.cli.serve_args.build_serve_config`; this module holds the dataclass and its checks only.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field, fields

from dflash_jax.errors import UserError

DRAFT_WEIGHT_QUANTIZATIONS = ("declared", "fp8", "fp8-aux", "nvfp4")


def _flag(help_text: str, **kw):
    return field(metadata={"help": help_text}, **kw)


@dataclass(frozen=True)
class ServeConfig:
    """Resolved serve configuration. `flag_name(f)` gives the CLI flag of field `f` (`--max-num-seqs`)."""

    model: str = _flag("target model: HF directory, GGUF file or 'default' (SmolLM2-135M-Instruct)", default="default")
    draft_model: str | None = _flag(
        "DFlash drafter (directory or 'random[:LAYERS]'); unset = the committed drafter of the default model",
        default=None,
    )
    no_spec: bool = _flag("serve without speculation (plain decoding)", default=False)
    tokenizer: str | None = _flag("tokenizer path (default: the model's own)", default=None)
    served_model_name: str | None = _flag("model id reported by /v1/models and accepted in requests", default=None)
    host: str = _flag("bind address; a non-loopback address needs --api-key or --allow-remote", default="127.0.0.1")
    port: int = _flag("TCP port", default=8000)
    api_key: str | None = _flag(
        "require 'Authorization: Bearer KEY' on the API (not on /health, /metrics)", default=None
    )
    allow_remote: bool = _flag("allow a non-loopback bind without --api-key", default=False)
    max_num_seqs: int = _flag("sequences decoded together (runner slots)", default=8)
    max_model_len: int | None = _flag("context length: prompt + generated tokens (default: the model's)", default=None)
    max_queued_requests: int = _flag("requests allowed to wait for a slot; beyond that: 429", default=64)
    seed: int = _flag("server random seed (per-request 'seed' overrides it for that request)", default=0)
    tp_size: int = _flag("tensor-parallel size of the target", default=1)
    draft_tp_size: str = _flag("drafter tensor-parallel size: 'auto' (= world size) or N", default="auto")
    coordinator_address: str | None = _flag(
        "multi-host: host:port of process 0 for jax.distributed.initialize", default=None
    )
    num_processes: int | None = _flag("multi-host: number of processes", default=None)
    process_id: int | None = _flag("multi-host: this process's rank (0 serves HTTP)", default=None)
    dflash_gamma: int | None = _flag("verify width gamma (gamma-1 drafts per step); unset = resolved", default=None)
    dflash_adaptive_k: str | None = _flag("adaptive draft count from a cost table 'drafts:ms,...'", default=None)
    dflash_draft_ladder: str | None = _flag("draft count by active sequences 'min_active:drafts,...'", default=None)
    draft_weight_quantization: str = _flag("drafter weights: declared | fp8 | fp8-aux | nvfp4", default="fp8")
    kernel_backend: str = _flag(
        "matmul backend for quantized drafter weights: auto (XLA on CPU, Pallas on GPU) | xla | pallas",
        default="auto",
    )
    speculative_config: str | None = _flag(
        "vLLM-style JSON: method, model, num_speculative_tokens, draft_tensor_parallel_size, max_model_len",
        default=None,
    )
    draft_max_model_len: int | None = _flag(
        "drafter context cap (from --speculative-config max_model_len)", default=None
    )
    shutdown_timeout: float = _flag("seconds to let in-flight requests finish after SIGTERM", default=30.0)
    compilation_cache_dir: str | None = _flag("JAX persistent compilation cache directory", default=None)
    max_request_bytes: int = _flag("largest accepted request body in bytes (larger: 413)", default=4 * 1024 * 1024)
    log_level: str = _flag("log level: debug | info | warning | error", default="info")

    def __post_init__(self) -> None:
        self._check()

    @property
    def speculative(self) -> bool:
        return not self.no_spec

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model

    def _check(self) -> None:
        def bad(name: str, msg: str) -> UserError:
            return UserError(f"{flag_name(name)}: {msg}", param=name)

        if not isinstance(self.port, int) or not 0 <= self.port <= 65535:
            raise bad("port", f"must be a TCP port 0..65535, got {self.port!r}")
        for name in ("max_num_seqs", "tp_size"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise bad(name, f"must be an integer >= 1, got {v!r}")
        if not isinstance(self.max_queued_requests, int) or self.max_queued_requests < 0:
            raise bad("max_queued_requests", f"must be an integer >= 0, got {self.max_queued_requests!r}")
        for name in ("max_model_len", "draft_max_model_len"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or v < 2):
                raise bad(name, f"must be an integer >= 2, got {v!r}")
        if self.max_request_bytes < 1024:
            raise bad("max_request_bytes", f"must be at least 1024, got {self.max_request_bytes}")
        if self.shutdown_timeout < 0:
            raise bad("shutdown_timeout", f"must be >= 0 seconds, got {self.shutdown_timeout}")
        if self.draft_tp_size != "auto":
            try:
                n = int(self.draft_tp_size)
            except ValueError:
                n = 0
            if n < 1:
                raise bad("draft_tp_size", f"must be 'auto' or an integer >= 1, got {self.draft_tp_size!r}")
        if any(getattr(self, n) is not None for n in ("coordinator_address", "num_processes", "process_id")):
            from dflash_jax.parallel.distributed import check_distributed_args  # imports jax: only when asked

            check_distributed_args(self.coordinator_address, self.num_processes, self.process_id)
        if self.dflash_gamma is not None and (not isinstance(self.dflash_gamma, int) or self.dflash_gamma < 2):
            raise bad(
                "dflash_gamma",
                f"must be an integer >= 2 (gamma-1 drafts per step), got {self.dflash_gamma!r}",
            )
        if self.draft_weight_quantization not in DRAFT_WEIGHT_QUANTIZATIONS:
            raise bad(
                "draft_weight_quantization",
                f"must be one of {', '.join(DRAFT_WEIGHT_QUANTIZATIONS)}, got {self.draft_weight_quantization!r}",
            )
        if self.log_level not in ("debug", "info", "warning", "error", "critical"):
            raise bad("log_level", f"must be debug, info, warning or error, got {self.log_level!r}")
        if self.api_key is not None and not self.api_key:
            raise bad("api_key", "must not be empty")
        if self.no_spec:
            spec_flags = [
                n
                for n in (
                    "draft_model",
                    "dflash_gamma",
                    "dflash_adaptive_k",
                    "dflash_draft_ladder",
                    "speculative_config",
                )
                if getattr(self, n) is not None
            ]
            if spec_flags:
                raise UserError(
                    f"--no-spec turns speculation off, but {', '.join(flag_name(n) for n in spec_flags)} "
                    "require(s) it: drop one or the other",
                    param=spec_flags[0],
                )

    def check_bind(self) -> None:
        """Refuse a non-loopback bind without an API key unless `allow_remote`."""
        if is_loopback(self.host) or self.api_key or self.allow_remote:
            return
        raise UserError(
            f"--host {self.host} exposes the server beyond this machine without authentication: "
            "set --api-key (or DFLASH_JAX_API_KEY), or pass --allow-remote to do it anyway",
            param="host",
        )

    def summary(self) -> dict[str, object]:
        """The resolved config for the start-up log (API key masked)."""
        out: dict[str, object] = {}
        for f in fields(self):
            v = getattr(self, f.name)
            out[f.name] = "***" if f.name == "api_key" and v else v
        return out


def flag_name(field_name: str) -> str:
    return "--" + field_name.replace("_", "-")


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False
