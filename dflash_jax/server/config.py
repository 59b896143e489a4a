"""`ServeConfig`: every `dflash-jax serve` setting in one frozen dataclass, validated once.

`build_serve_config(given)` folds `--speculative-config` (vLLM's JSON keys) into the matching settings and builds
the config; the typer options that collect `given` from flags and `DFLASH_JAX_*` environment variables are in
`dflash_jax.server.options`.
"""

from __future__ import annotations

import ipaddress
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from dflash_jax.checkpoints.tokenizer import TOOL_CALL_PARSERS
from dflash_jax.engine.engine import DEFAULT_MAX_NUM_BATCHED_TOKENS
from dflash_jax.errors import UserError
from dflash_jax.kernels.backends import ATTENTION_BACKEND_FLAGS as ATTENTION_BACKENDS
from dflash_jax.kv.pages import PAGE_SIZES
from dflash_jax.kv.sizing import PoolFlags
from dflash_jax.models.layers import DENSE_LAYOUTS

DEFAULT_COMPILATION_CACHE_DIR = "~/.cache/dflash-jax/jax-compilation-cache"  # without the flag or JAX's variable
DRAFT_WEIGHT_QUANTIZATIONS = ("declared", "fp8", "fp8-aux", "nvfp4")
DTYPES = ("auto", "bfloat16", "float16", "float32")  # `builder.resolve_dtype`
ENV_PREFIX = "DFLASH_JAX_"
SPEC_JSON_KEYS = ("method", "model", "num_speculative_tokens", "draft_tensor_parallel_size", "max_model_len")
SPEC_METHODS = ("dflash",)
DRAFT_METHODS = ("dflash", "hybrid")  # `--draft-method`: the drafter's proposals, or n-gram drafts beside them
_BYTE_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "m": 1000**2,
    "mb": 1000**2,
    "g": 1000**3,
    "gb": 1000**3,
    "t": 1000**4,
    "tb": 1000**4,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
}


@dataclass(frozen=True)
class ServeConfig:
    """Resolved serve configuration: one field per `dflash-jax serve` flag (`flag_name("max_num_seqs")` is
    `--max-num-seqs`, `env_name("max_num_seqs")` is `DFLASH_JAX_MAX_NUM_SEQS`); the flags and their help are in
    `dflash_jax.server.options`."""

    model: str = "default"
    draft_model: str | None = None
    dtype: str = "auto"
    no_spec: bool = False
    tokenizer: str | None = None
    served_model_name: str | None = None
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    allow_remote: bool = False
    max_num_seqs: int = 8
    max_model_len: int | None = None
    max_queued_requests: int = 64
    max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS
    step_token_budget: int | None = None  # None: by platform (`builder.default_step_token_budget`)
    async_scheduling: bool = False  # dispatch step n+1 before reading step n (`engine.Engine(overlap=...)`)
    seed: int = 0
    tp_size: int = 1
    draft_tp_size: str = "auto"
    coordinator_address: str | None = None
    num_processes: int | None = None
    process_id: int | None = None
    dflash_gamma: int | None = None
    dflash_adaptive_k: str | None = None
    dflash_objective: str | None = None  # None: latency (`spec_decode.control.Controller`)
    dflash_draft_ladder: str | None = None
    draft_method: str = "dflash"
    draft_weight_quantization: str = "declared"
    kernel_backend: str = "auto"
    speculative_config: str | None = None
    draft_max_model_len: int | None = None
    shutdown_timeout: float = 30.0
    compilation_cache_dir: str | None = None
    warmup: bool = True
    warmup_background: bool = True
    max_request_bytes: int = 4 * 1024 * 1024
    log_level: str = "info"
    kv_cache_memory: int | None = None
    gpu_memory_utilization: float | None = None
    block_size: int = 16
    enable_prefix_caching: bool = True
    attention_backend: str = "auto"
    dense_layout: str = "auto"
    deterministic: bool = False
    tool_call_parser: str = "auto"  # auto: the chat template's format (`build_serving` resolves it)

    def __post_init__(self) -> None:
        if isinstance(self.kv_cache_memory, str):
            object.__setattr__(self, "kv_cache_memory", parse_bytes(self.kv_cache_memory, "kv_cache_memory"))
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
        for name in ("max_num_seqs", "tp_size", "max_num_batched_tokens"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise bad(name, f"must be an integer >= 1, got {v!r}")
        v = self.step_token_budget
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 0):
            raise bad("step_token_budget", f"must be an integer >= 0 (0: prompts prefill between steps), got {v!r}")
        if not isinstance(self.max_queued_requests, int) or self.max_queued_requests < 0:
            raise bad("max_queued_requests", f"must be an integer >= 0, got {self.max_queued_requests!r}")
        for name in ("max_model_len", "draft_max_model_len"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or v < 2):
                raise bad(name, f"must be an integer >= 2, got {v!r}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise bad(
                "attention_backend", f"must be one of {', '.join(ATTENTION_BACKENDS)}, got {self.attention_backend!r}"
            )
        if self.dense_layout not in DENSE_LAYOUTS:
            raise bad("dense_layout", f"must be one of {', '.join(DENSE_LAYOUTS)}, got {self.dense_layout!r}")
        if self.dense_layout == "out-in" and self.tp_size > 1:
            raise bad("dense_layout", "out-in runs on one device: give --tp-size 1 or --dense-layout auto")
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
        if self.draft_method not in DRAFT_METHODS:
            raise bad("draft_method", f"must be one of {', '.join(DRAFT_METHODS)}, got {self.draft_method!r}")
        if self.draft_method == "hybrid":
            clash = [n for n in ("async_scheduling",) if getattr(self, n)]
            clash += [n for n in ("tp_size",) if self.tp_size > 1]
            clash += [n for n in ("coordinator_address", "num_processes") if getattr(self, n) is not None]
            if clash:
                raise UserError(
                    f"--draft-method hybrid proposes each step's n-gram drafts on this host from the tokens of the "
                    f"step before, one step at a time on one device: drop {flag_name(clash[0])}, or serve with "
                    "--draft-method dflash",
                    param="draft_method",
                )
        if self.tool_call_parser not in TOOL_CALL_PARSERS:
            raise bad(
                "tool_call_parser",
                f"must be one of {', '.join(TOOL_CALL_PARSERS)} (auto: the chat template's format), "
                f"got {self.tool_call_parser!r}",
            )
        if self.dtype not in DTYPES:
            raise bad("dtype", f"must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.draft_weight_quantization not in DRAFT_WEIGHT_QUANTIZATIONS:
            raise bad(
                "draft_weight_quantization",
                f"must be one of {', '.join(DRAFT_WEIGHT_QUANTIZATIONS)}, got {self.draft_weight_quantization!r}",
            )
        if self.kv_cache_memory is not None and self.gpu_memory_utilization is not None:
            raise UserError(
                "--kv-cache-memory and --gpu-memory-utilization both size the KV pool: give one of them",
                param="kv_cache_memory",
            )
        kv = self.kv_cache_memory
        if kv is not None and (not isinstance(kv, int) or isinstance(kv, bool) or kv < 1):
            raise bad("kv_cache_memory", f"must be a positive number of bytes (e.g. 8GiB), got {kv!r}")
        f = self.gpu_memory_utilization
        if f is not None and (isinstance(f, bool) or not isinstance(f, (int, float)) or not 0 < f <= 1):
            raise bad("gpu_memory_utilization", f"must be a fraction 0 < f <= 1, got {f!r}")
        if self.block_size not in PAGE_SIZES:
            raise bad("block_size", f"must be one of {', '.join(map(str, PAGE_SIZES))} tokens, got {self.block_size!r}")
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
                    "dflash_objective",
                    "dflash_draft_ladder",
                    "speculative_config",
                )
                if getattr(self, n) is not None
            ] + (["deterministic"] if self.deterministic else [])
            spec_flags += ["draft_method"] if self.draft_method != "dflash" else []
            if spec_flags:
                raise UserError(
                    f"--no-spec turns speculation off, but {', '.join(flag_name(n) for n in spec_flags)} "
                    "require(s) it: drop one or the other",
                    param=spec_flags[0],
                )

    def pool_flags(self) -> PoolFlags:
        """The flags that size the KV page pool (`kv.sizing.plan_kv_pool`)."""
        pool = (self.block_size, self.max_num_seqs, self.enable_prefix_caching, self.kv_cache_memory)
        return PoolFlags(*pool, self.gpu_memory_utilization)

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


def parse_bytes(text: str | int, name: str = "kv_cache_memory") -> int:
    """A byte count from a plain integer or a number with a unit: `8GiB`, `500MB`, `1.5 GiB`, `70GB`, `4096`
    (k/M/G/T and kB/MB/GB/TB are powers of 1000, KiB/MiB/GiB/TiB powers of 1024; case does not matter). A bad
    value is a UserError naming the flag."""
    if isinstance(text, int) and not isinstance(text, bool):
        return text
    s = str(text).strip().replace("_", "")
    i = len(s)
    while i > 0 and s[i - 1].isalpha():
        i -= 1
    number, unit = s[:i].strip(), s[i:].lower()
    value: int | float | None
    try:
        value = int(number)
    except ValueError:
        try:
            value = float(number)
        except ValueError:
            value = None
    if value is None or unit not in _BYTE_UNITS or not math.isfinite(value):
        raise UserError(
            f"{flag_name(name)}: {text!r} is not a byte count; give an integer or a number with a unit "
            "(B, kB, MB, GB, TB, KiB, MiB, GiB, TiB), e.g. 8GiB",
            param=name,
        )
    return int(value * _BYTE_UNITS[unit])


def flag_name(field_name: str) -> str:
    return "--" + field_name.replace("_", "-")


def env_name(field_name: str) -> str:
    return ENV_PREFIX + field_name.upper()


def build_serve_config(given: Mapping[str, Any] | None = None) -> ServeConfig:
    """A validated `ServeConfig` from the settings given explicitly (by flag or environment variable; the rest
    keep their defaults), with `--speculative-config` folded into the flags it names:
    `build_serve_config({"port": 9000, "no_spec": True})`."""
    given = dict(given or {})
    known = {f.name for f in fields(ServeConfig)}
    unknown = sorted(set(given) - known)
    if unknown:
        raise UserError(f"unknown serve option(s): {', '.join(unknown)}")
    if given.get("speculative_config"):
        _fold_speculative_config(given)
    try:
        return ServeConfig(**given)
    except TypeError as e:  # a wrongly typed programmatic value
        raise UserError(f"bad serve option: {e}") from None


def _fold_speculative_config(given: dict[str, Any]) -> None:
    """`--speculative-config` JSON -> the flags it stands for (`model` -> --draft-model, `num_speculative_tokens`
    N -> --dflash-gamma N+1, `draft_tensor_parallel_size` -> --draft-tp-size, `max_model_len` -> the drafter's
    context cap). A key that contradicts an explicitly given flag, an unknown key and `tensor_parallel_size` are
    errors."""
    raw = given["speculative_config"]
    try:
        spec = json.loads(raw)
    except ValueError as e:
        raise UserError(f"--speculative-config is not valid JSON ({e}): {raw!r}", param="speculative_config") from None
    if not isinstance(spec, dict):
        raise UserError(
            "--speculative-config must be a JSON object like "
            '\'{"method": "dflash", "model": "DRAFTER", "num_speculative_tokens": 15}\'',
            param="speculative_config",
        )
    if "tensor_parallel_size" in spec:
        raise UserError(
            "--speculative-config: 'tensor_parallel_size' is not a drafter setting here; set the target's with "
            "--tp-size and the drafter's with 'draft_tensor_parallel_size' (or --draft-tp-size)",
            param="speculative_config",
        )
    unknown = sorted(set(spec) - set(SPEC_JSON_KEYS))
    if unknown:
        raise UserError(
            f"--speculative-config: unknown key(s) {', '.join(unknown)}; allowed: {', '.join(SPEC_JSON_KEYS)}",
            param="speculative_config",
        )
    method = spec.get("method", "dflash")
    if not isinstance(method, str) or method.lower() not in SPEC_METHODS:
        raise UserError(
            f'--speculative-config: method {method!r} is not supported; use "dflash"',
            param="speculative_config",
        )

    def _int(key: str, minimum: int) -> int:
        v = spec[key]
        if not isinstance(v, int) or isinstance(v, bool) or v < minimum:
            raise UserError(
                f"--speculative-config: '{key}' must be an integer >= {minimum}, got {v!r}",
                param="speculative_config",
            )
        return v

    def _set(name: str, value: Any, key: str) -> None:
        if name in given and given[name] != value:
            raise UserError(
                f"--speculative-config '{key}' gives {flag_name(name)} {value!r} but {flag_name(name)} is "
                f"{given[name]!r}: give it once",
                param="speculative_config",
            )
        given[name] = value

    if "model" in spec:
        if not isinstance(spec["model"], str) or not spec["model"]:
            raise UserError("--speculative-config: 'model' must be a non-empty string", param="speculative_config")
        _set("draft_model", spec["model"], "model")
    if "num_speculative_tokens" in spec:
        _set("dflash_gamma", _int("num_speculative_tokens", 1) + 1, "num_speculative_tokens")
    if "draft_tensor_parallel_size" in spec:
        _set("draft_tp_size", str(_int("draft_tensor_parallel_size", 1)), "draft_tensor_parallel_size")
    if "max_model_len" in spec:
        _set("draft_max_model_len", _int("max_model_len", 2), "max_model_len")


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False
