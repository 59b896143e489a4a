"""ServeConfig and the serve flags: flags > DFLASH_JAX_* env > defaults, --speculative-config JSON."""

from __future__ import annotations

import os

import pytest
import typer
from typer.testing import CliRunner

from dflash_jax.errors import UserError
from dflash_jax.server.config import ServeConfig, build_serve_config, env_name, parse_bytes
from dflash_jax.server.options import serve_command


def _invoke(argv: list[str], env: dict[str, str]):
    """Run the serve command (its start replaced by capturing the config): (exit code, output, config)."""
    seen: list[ServeConfig] = []
    app = typer.Typer(add_completion=False, pretty_exceptions_enable=False)
    app.command()(serve_command(lambda cfg: seen.append(cfg) or 0))
    clean = {k: None for k in os.environ if k.startswith("DFLASH_JAX_")}  # the test's env only
    r = CliRunner().invoke(app, argv, env={**clean, **env})
    text = " ".join(r.output.replace("\u2502", " ").split())  # unwrap typer's error box
    return r.exit_code, text, (seen[0] if seen else None)


def parse_serve_argv(argv: list[str], env: dict[str, str]) -> ServeConfig:
    code, text, cfg = _invoke(argv, env)
    assert code == 0 and cfg is not None, text
    return cfg


def refuse(argv: list[str], env: dict[str, str]) -> str:
    code, text, cfg = _invoke(argv, env)
    assert code == 2 and cfg is None, (code, text)
    return text


def test_defaults_are_safe():
    cfg = parse_serve_argv([], env={})
    assert cfg == ServeConfig() == build_serve_config({})
    assert cfg.host == "127.0.0.1" and cfg.api_key is None and cfg.speculative
    cfg.check_bind()


def test_flag_beats_env_beats_default():
    env = {
        "DFLASH_JAX_PORT": "9001",
        "DFLASH_JAX_MAX_NUM_SEQS": "16",
        "DFLASH_JAX_NO_SPEC": "true",
        "DFLASH_JAX_SHUTDOWN_TIMEOUT": "2.5",
        "DFLASH_JAX_API_KEY": "k",
    }
    cfg = parse_serve_argv(["--port", "9002"], env=env)
    assert cfg.port == 9002 and cfg.max_num_seqs == 16 and cfg.no_spec and cfg.shutdown_timeout == 2.5
    assert cfg.api_key == "k"
    assert env_name("max_queued_requests") == "DFLASH_JAX_MAX_QUEUED_REQUESTS"


def test_every_field_has_an_env_var_and_a_flag():
    argv, env = [], {}
    cfg = parse_serve_argv(["--max-num-seqs", "3", "--no-spec", "--host", "::1", "--draft-tp-size", "2"], env=env)
    assert cfg.max_num_seqs == 3 and cfg.no_spec and cfg.host == "::1" and cfg.draft_tp_size == "2"
    cfg = parse_serve_argv(
        argv,
        env={
            "DFLASH_JAX_DFLASH_GAMMA": "8",
            "DFLASH_JAX_DRAFT_WEIGHT_QUANTIZATION": "nvfp4",
            "DFLASH_JAX_ALLOW_REMOTE": "1",
            "DFLASH_JAX_MAX_MODEL_LEN": "1024",
        },
    )
    assert cfg.dflash_gamma == 8 and cfg.draft_weight_quantization == "nvfp4" and cfg.allow_remote
    assert cfg.max_model_len == 1024
    assert parse_serve_argv(["--dtype", "bfloat16"], env={}).dtype == "bfloat16"
    assert parse_serve_argv([], env={"DFLASH_JAX_DTYPE": "float16"}).dtype == "float16"
    assert ServeConfig().dtype == "auto"
    assert ServeConfig().max_num_batched_tokens == 2048
    assert parse_serve_argv(["--max-num-batched-tokens", "512"], env={}).max_num_batched_tokens == 512
    assert parse_serve_argv([], env={"DFLASH_JAX_MAX_NUM_BATCHED_TOKENS": "64"}).max_num_batched_tokens == 64


@pytest.mark.parametrize(
    "env,needle",
    [
        ({"DFLASH_JAX_PORT": "eighty"}, "DFLASH_JAX_PORT"),
        ({"DFLASH_JAX_NO_SPEC": "maybe"}, "DFLASH_JAX_NO_SPEC"),
        ({"DFLASH_JAX_PORT": "70000"}, "--port"),
        ({"DFLASH_JAX_MAX_NUM_SEQS": "0"}, "--max-num-seqs"),
        ({"DFLASH_JAX_DRAFT_TP_SIZE": "three"}, "--draft-tp-size"),
        ({"DFLASH_JAX_DFLASH_GAMMA": "1"}, "--dflash-gamma"),
        ({"DFLASH_JAX_DRAFT_WEIGHT_QUANTIZATION": "int3"}, "--draft-weight-quantization"),
        ({"DFLASH_JAX_NO_SPEC": "1", "DFLASH_JAX_DFLASH_GAMMA": "4"}, "--no-spec"),
        ({"DFLASH_JAX_SHUTDOWN_TIMEOUT": "-1"}, "--shutdown-timeout"),
        ({"DFLASH_JAX_DTYPE": "fp8"}, "--dtype"),
        ({"DFLASH_JAX_MAX_NUM_BATCHED_TOKENS": "0"}, "--max-num-batched-tokens"),
        ({"DFLASH_JAX_MAX_NUM_BATCHED_TOKENS": "many"}, "DFLASH_JAX_MAX_NUM_BATCHED_TOKENS"),
    ],
)
def test_bad_values_name_the_flag_or_variable(env, needle):
    assert needle in refuse([], env=env)


def test_speculative_config_vllm_keys():
    js = (
        '{"method": "dflash", "model": "z-lab/Qwen3-8B-DFlash-b16", "num_speculative_tokens": 15, '
        '"draft_tensor_parallel_size": 1, "max_model_len": 4096}'
    )
    cfg = parse_serve_argv(["--speculative-config", js], env={})
    assert cfg.draft_model == "z-lab/Qwen3-8B-DFlash-b16" and cfg.dflash_gamma == 16
    assert cfg.draft_tp_size == "1" and cfg.draft_max_model_len == 4096
    # consistent explicit flags are fine
    cfg = parse_serve_argv(["--speculative-config", js, "--dflash-gamma", "16"], env={})
    assert cfg.dflash_gamma == 16
    assert build_serve_config({"speculative_config": js}) == parse_serve_argv(
        [], env={"DFLASH_JAX_SPECULATIVE_CONFIG": js}
    )


@pytest.mark.parametrize(
    "js,needle",
    [
        ("{not json", "not valid JSON"),
        ("[1]", "JSON object"),
        ('{"method": "eagle"}', "eagle"),
        ('{"method": "dflash", "tensor_parallel_size": 2}', "--tp-size"),
        ('{"method": "dflash", "num_speculative_tokens": 0}', "num_speculative_tokens"),
        ('{"method": "dflash", "num_speculative_tokens": "7"}', "num_speculative_tokens"),
        ('{"method": "dflash", "foo": 1}', "foo"),
    ],
)
def test_speculative_config_refusals(js, needle):
    with pytest.raises(UserError, match=needle):
        build_serve_config({"speculative_config": js})
    assert needle in refuse(["--speculative-config", js], env={})


def test_speculative_config_conflicts_with_flags():
    js = '{"method": "dflash", "model": "a", "num_speculative_tokens": 7}'
    assert "--draft-model" in refuse(["--speculative-config", js, "--draft-model", "b"], env={})
    assert "--dflash-gamma" in refuse(["--speculative-config", js], env={"DFLASH_JAX_DFLASH_GAMMA": "4"})
    assert "--no-spec" in refuse(["--speculative-config", js, "--no-spec"], env={})
    # a flag left at its default is not a conflict: only the given ones count
    cfg = parse_serve_argv(["--speculative-config", js, "--draft-tp-size", "auto"], env={})
    assert cfg.draft_tp_size == "auto" and cfg.dflash_gamma == 8
    with pytest.raises(UserError, match="--draft-model"):
        build_serve_config({"speculative_config": js, "draft_model": "b"})


def test_unknown_option_and_masked_summary():
    with pytest.raises(UserError, match="bogus"):
        build_serve_config({"bogus": 1})
    s = ServeConfig(api_key="secret").summary()
    assert s["api_key"] == "***" and "secret" not in str(s)


@pytest.mark.parametrize(
    "text,n",
    [
        ("4096", 4096),
        ("8GiB", 8 * 1024**3),
        ("8 gib", 8 * 1024**3),
        ("500MB", 500 * 10**6),
        ("1.5GiB", 1610612736),
        ("70GB", 70 * 10**9),
        ("2k", 2000),
        ("64KiB", 65536),
        ("1_000_000", 10**6),
        ("123456789012345678901", 123456789012345678901),  # an integer stays exact
    ],
)
def test_kv_cache_memory_takes_plain_and_suffixed_byte_counts(text, n):
    assert parse_bytes(text) == n
    assert ServeConfig(kv_cache_memory=text).kv_cache_memory == n
    assert parse_serve_argv(["--kv-cache-memory", text], env={}).kv_cache_memory == n


@pytest.mark.parametrize("text", ["lots", "GiB", "8 XB", "nan", "inf GB", "1e999GB", ""])
def test_bad_byte_count_names_the_flag(text):
    with pytest.raises(UserError, match="--kv-cache-memory: .* is not a byte count") as e:
        parse_bytes(text)
    assert e.value.param == "kv_cache_memory"
    out = refuse(["--kv-cache-memory", text], env={})
    assert "--kv-cache-memory" in out and "is not a byte count" in out


def test_kv_pool_flags_and_their_variables():
    cfg = ServeConfig()
    assert (cfg.kv_cache_memory, cfg.gpu_memory_utilization, cfg.block_size, cfg.enable_prefix_caching) == (
        None,
        None,
        16,
        True,
    )
    cfg = parse_serve_argv(["--gpu-memory-utilization", "0.9", "--block-size", "32", "--no-enable-prefix-caching"], {})
    assert (cfg.gpu_memory_utilization, cfg.block_size, cfg.enable_prefix_caching) == (0.9, 32, False)
    cfg = parse_serve_argv(
        [],
        env={
            "DFLASH_JAX_KV_CACHE_MEMORY": "500MB",
            "DFLASH_JAX_BLOCK_SIZE": "32",
            "DFLASH_JAX_ENABLE_PREFIX_CACHING": "0",
        },
    )
    assert (cfg.kv_cache_memory, cfg.block_size, cfg.enable_prefix_caching) == (500 * 10**6, 32, False)
    assert parse_serve_argv(
        ["--enable-prefix-caching"], {"DFLASH_JAX_ENABLE_PREFIX_CACHING": "0"}
    ).enable_prefix_caching
    assert parse_serve_argv([], {"DFLASH_JAX_GPU_MEMORY_UTILIZATION": "1"}).gpu_memory_utilization == 1.0


@pytest.mark.parametrize(
    "argv,env,needle",
    [
        (["--block-size", "64"], {}, "--block-size: must be one of 16, 32 tokens, got 64"),
        (["--gpu-memory-utilization", "0"], {}, "--gpu-memory-utilization: must be a fraction 0 < f <= 1, got 0.0"),
        (["--gpu-memory-utilization", "1.5"], {}, "--gpu-memory-utilization: must be a fraction 0 < f <= 1"),
        (["--kv-cache-memory", "0"], {}, "--kv-cache-memory: must be a positive number of bytes"),
        (["--kv-cache-memory", "-1GiB"], {}, "--kv-cache-memory: must be a positive number of bytes"),
        (
            ["--kv-cache-memory", "8GiB"],
            {"DFLASH_JAX_GPU_MEMORY_UTILIZATION": "0.9"},
            "--kv-cache-memory and --gpu-memory-utilization both size the KV pool: give one of them",
        ),
        ([], {"DFLASH_JAX_BLOCK_SIZE": "sixteen"}, "DFLASH_JAX_BLOCK_SIZE"),
    ],
)
def test_kv_pool_flag_refusals(argv, env, needle):
    assert needle in refuse(argv, env=env)


def test_every_serve_flag_is_a_config_field_with_its_default():
    """The flags are defined once: one typer option per `ServeConfig` field, whose default is the field's."""
    import dataclasses
    import inspect

    params = {
        name: p.default
        for name, p in inspect.signature(serve_command(lambda cfg: 0)).parameters.items()
        if name != "ctx"
    }
    defaults = ServeConfig()
    assert set(params) == {f.name for f in dataclasses.fields(ServeConfig)}
    assert {name: getattr(defaults, name) for name in params} == params


def test_deterministic_flag_and_its_conflict_with_no_spec():
    assert parse_serve_argv(["--deterministic"], env={}).deterministic
    assert parse_serve_argv([], env={"DFLASH_JAX_DETERMINISTIC": "1"}).deterministic
    assert not ServeConfig().deterministic
    text = refuse(["--deterministic", "--no-spec"], env={})
    assert "--no-spec" in text and "--deterministic" in text


def test_step_token_budget_flag():
    assert ServeConfig().step_token_budget is None  # the platform's default, resolved by the builder
    assert parse_serve_argv(["--step-token-budget", "256"], env={}).step_token_budget == 256
    assert parse_serve_argv([], env={"DFLASH_JAX_STEP_TOKEN_BUDGET": "0"}).step_token_budget == 0
    assert "--step-token-budget" in refuse(["--step-token-budget", "-1"], env={})
    with pytest.raises(UserError, match="--step-token-budget"):
        ServeConfig(step_token_budget=-5)


def test_async_scheduling_flag():
    assert not ServeConfig().async_scheduling
    assert parse_serve_argv(["--async-scheduling"], env={}).async_scheduling
    assert not parse_serve_argv(["--no-async-scheduling"], env={"DFLASH_JAX_ASYNC_SCHEDULING": "1"}).async_scheduling
    assert parse_serve_argv([], env={"DFLASH_JAX_ASYNC_SCHEDULING": "1"}).async_scheduling


def test_step_token_budget_default_by_platform_and_under_deterministic():
    from dflash_jax.builder import default_step_token_budget, resolve_step_token_budget

    assert default_step_token_budget("cpu") == 64 and default_step_token_budget("gpu") == 2048
    assert resolve_step_token_budget(None) == default_step_token_budget()
    assert resolve_step_token_budget(64) == 64 and resolve_step_token_budget(0) == 0
    assert resolve_step_token_budget(None, deterministic=True) == 0
    with pytest.raises(UserError, match="--deterministic"):
        resolve_step_token_budget(64, deterministic=True)


def test_tool_call_parser_flag():
    assert ServeConfig().tool_call_parser == "auto"  # the chat template's format, resolved by the builder
    assert parse_serve_argv(["--tool-call-parser", "llama3"], env={}).tool_call_parser == "llama3"
    assert parse_serve_argv([], env={"DFLASH_JAX_TOOL_CALL_PARSER": "hermes"}).tool_call_parser == "hermes"
    # a bad value is a usage error of the flag (typer's), naming the choices
    text = refuse(["--tool-call-parser", "mistral"], env={})
    assert "--tool-call-parser" in text and "auto, hermes, llama3" in text and "'mistral'" in text
    assert "DFLASH_JAX_TOOL_CALL_PARSER" in refuse([], env={"DFLASH_JAX_TOOL_CALL_PARSER": "Hermes"})
    with pytest.raises(UserError, match=r"^--tool-call-parser: must be one of auto, hermes, llama3") as e:
        ServeConfig(tool_call_parser="json")
    assert e.value.param == "tool_call_parser"


def test_the_app_resolves_the_tool_call_parser_against_the_template():
    """An app built directly (not through `build_serving`) resolves auto from its tokenizer's chat template and
    refuses a parser the template contradicts."""
    from dflash_jax.checkpoints.tokenizer import TextTokenizer
    from dflash_jax.server.app import create_app
    from dflash_jax.testing.fake_runner import FakeRunner
    from tests.server.test_tools_parse import LLAMA_STYLE, QWEN_STYLE
    from tests.spec_decode.test_grammar import _Tok

    def app(template: str, parser: str):
        tok = TextTokenizer(_Tok().tk, chat_template=template, bos_token=None, eos_token=None)
        return create_app(FakeRunner([5, 6]), tok, ServeConfig(tool_call_parser=parser))

    for template, fmt in ((QWEN_STYLE, "hermes"), (LLAMA_STYLE, "llama3")):
        assert app(template, "auto").state.tool_call_parser == fmt
        assert app(template, fmt).state.tool_call_parser == fmt
    with pytest.raises(UserError, match=r"^--tool-call-parser hermes: the chat template renders llama3"):
        app(LLAMA_STYLE, "hermes")


def test_draft_method_flag_and_its_conflicts():
    assert ServeConfig().draft_method == "dflash"
    assert parse_serve_argv(["--draft-method", "hybrid"], env={}).draft_method == "hybrid"
    assert parse_serve_argv([], env={"DFLASH_JAX_DRAFT_METHOD": "hybrid"}).draft_method == "hybrid"
    assert "--draft-method" in refuse(["--draft-method", "eagle"], env={})
    for other in (["--async-scheduling"], ["--tp-size", "2"]):
        text = refuse(["--draft-method", "hybrid", *other], env={})
        assert "--draft-method hybrid" in text and other[0] in text
    text = refuse(["--draft-method", "hybrid", "--no-spec"], env={})
    assert "--no-spec" in text and "--draft-method" in text
