"""`dflash-jax serve`: one flag and one DFLASH_JAX_* variable per ServeConfig field, with its default, all in --help."""

from __future__ import annotations

import dataclasses

import typer
from typer.testing import CliRunner

from dflash_jax.cli.main import app
from dflash_jax.server.config import ServeConfig, env_name, flag_name


def _serve_params():
    cmd = typer.main.get_command(app).commands["serve"]
    return {p.name: p for p in cmd.params}


def test_every_config_field_is_a_flag_with_its_env_var_and_default():
    params = _serve_params()
    fields = {f.name: f for f in dataclasses.fields(ServeConfig)}
    assert set(params) == set(fields)
    for name, f in fields.items():
        p = params[name]
        assert p.opts == [flag_name(name)], p.opts
        assert p.envvar == env_name(name)
        assert p.default == f.default, (name, p.default, f.default)
        assert p.help, name


def test_serve_help_lists_every_flag_and_variable():
    r = CliRunner().invoke(app, ["serve", "--help"], terminal_width=200, env={"COLUMNS": "200"})
    assert r.exit_code == 0, r.output
    for f in dataclasses.fields(ServeConfig):
        assert flag_name(f.name) in r.output, f.name
        assert env_name(f.name) in r.output, f.name
    assert "DFLASH_JAX_MAX_NUM_SEQS" in r.output and "default: 8" in r.output


def test_bad_environment_value_is_a_usage_error_naming_flag_and_variable():
    r = CliRunner().invoke(app, ["serve"], env={"DFLASH_JAX_MAX_NUM_SEQS": "many"}, terminal_width=200)
    assert r.exit_code == 2
    text = " ".join(r.output.replace("\u2502", " ").split())
    assert "--max-num-seqs" in text and "DFLASH_JAX_MAX_NUM_SEQS" in text


def test_compilation_cache_dir_is_the_flag_then_jaxs_variable_then_the_default(monkeypatch, tmp_path):
    from pathlib import Path

    from dflash_jax.cli.serve import compilation_cache_dir
    from dflash_jax.server.config import DEFAULT_COMPILATION_CACHE_DIR

    monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR", raising=False)
    assert compilation_cache_dir(ServeConfig()) == str(Path(DEFAULT_COMPILATION_CACHE_DIR).expanduser())
    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", str(tmp_path / "jax"))
    assert compilation_cache_dir(ServeConfig()) == str(tmp_path / "jax")
    flag = ServeConfig(compilation_cache_dir=str(tmp_path / "flag"))
    assert compilation_cache_dir(flag) == str(tmp_path / "flag")
