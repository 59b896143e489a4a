"""Build a `ServeConfig` from serve flags, `DFLASH_JAX_*` environment variables and `--speculative-config`.

Precedence: a flag given on the command line > its environment variable (`--max-num-seqs` ->
`DFLASH_JAX_MAX_NUM_SEQS`) > the default. `--speculative-config` takes vLLM's JSON keys and folds them into
the matching flags (`model` -> --draft-model, `num_speculative_tokens` N -> --dflash-gamma N+1,
`draft_tensor_parallel_size` -> --draft-tp-size, `max_model_len` -> the drafter's context cap); a key that
contradicts an explicit flag is an error, and so is an unknown key or `tensor_parallel_size`.

Two entry points:
  * `build_serve_config(values)`: `values` maps field names to flag values with None = not given (what a
    typer command with `None` defaults collects), e.g. `build_serve_config({"port": 9000, "model": None})`.
  * `parse_serve_argv(argv)`: the same from raw argv (argparse), e.g. for a typer command that passes its
    extra args through, or for test launchers.
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import MISSING, Field, fields
from typing import Any

from dflash_jax.errors import UserError
from dflash_jax.server.config import ServeConfig, flag_name

ENV_PREFIX = "DFLASH_JAX_"
SPEC_JSON_KEYS = ("method", "model", "num_speculative_tokens", "draft_tensor_parallel_size", "max_model_len")
SPEC_METHODS = ("dflash",)

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


def env_name(field_name: str) -> str:
    return ENV_PREFIX + field_name.upper()


def _kind(f: Field) -> str:
    """'bool' | 'int' | 'float' | 'str' from the (string) annotation."""
    ann = str(f.type).replace("None", "").replace("|", "").strip()
    return ann if ann in ("bool", "int", "float") else "str"


def _convert(f: Field, raw: str, source: str) -> Any:
    kind = _kind(f)
    text = raw.strip()
    try:
        if kind == "bool":
            low = text.lower()
            if low in _TRUE:
                return True
            if low in _FALSE:
                return False
            raise ValueError
        if kind == "int":
            return int(text)
        if kind == "float":
            return float(text)
    except ValueError:
        expected = {"bool": "true/false (1/0)", "int": "an integer", "float": "a number"}[kind]
        raise UserError(f"{source}={raw!r}: expected {expected}", param=f.name) from None
    return raw


def serve_fields() -> list[Field]:
    return list(fields(ServeConfig))


def build_serve_config(values: Mapping[str, Any] | None = None, *, env: Mapping[str, str] | None = None) -> ServeConfig:
    """Resolve flags (None / False = not given), environment and defaults into a validated `ServeConfig`."""
    values = dict(values or {})
    env = os.environ if env is None else env
    known = {f.name: f for f in serve_fields()}
    unknown = sorted(set(values) - set(known))
    if unknown:
        raise UserError(f"unknown serve option(s): {', '.join(unknown)}")
    given: dict[str, Any] = {}  # explicitly set, by flag or by environment
    for name, f in known.items():
        v = values.get(name)
        if v is False and _kind(f) == "bool":
            v = None
        if v is None and env_name(name) in env:
            v = _convert(f, env[env_name(name)], env_name(name))
        if v is not None:
            if _kind(f) == "str" and not isinstance(v, str):
                v = str(v)
            given[name] = v
    if given.get("speculative_config"):
        _fold_speculative_config(given)
    try:
        return ServeConfig(**given)
    except TypeError as e:  # a wrongly typed programmatic value
        raise UserError(f"bad serve option: {e}") from None


def _fold_speculative_config(given: dict[str, Any]) -> None:
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
            "--speculative-config: 'tensor_parallel_size' is not a drafter setting here; set the target's "
            "with "
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


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """One argparse option per `ServeConfig` field (defaults None, so env/defaults resolve later)."""
    for f in serve_fields():
        help_text = f"{f.metadata.get('help', '')} [env {env_name(f.name)}]"
        if f.default is not MISSING:
            help_text += f" (default: {f.default})"
        kind = _kind(f)
        if kind == "bool":
            parser.add_argument(flag_name(f.name), dest=f.name, action="store_true", default=None, help=help_text)
        else:
            conv = {"int": int, "float": float, "str": str}[kind]
            parser.add_argument(flag_name(f.name), dest=f.name, type=conv, default=None, help=help_text)


def parse_serve_argv(argv: Sequence[str] | None = None, *, env: Mapping[str, str] | None = None) -> ServeConfig:
    parser = argparse.ArgumentParser(prog="dflash-jax serve", description="Serve the OpenAI-compatible API.")
    add_serve_arguments(parser)
    ns = parser.parse_args(argv)
    return build_serve_config(vars(ns), env=env)
