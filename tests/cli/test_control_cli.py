"""`dflash-jax spec plan`: the planner's numbers, JSON, and clean errors for bad flags."""

from __future__ import annotations

import json
import re

import pytest
from typer.testing import CliRunner

runner = CliRunner()


def _app_and_prefix():
    """The full CLI when it imports; else the `spec` sub-app alone (another command may be mid-edit)."""
    try:
        from dflash_jax.cli.main import app

        return app, ["spec", "plan"]
    except ImportError:
        from dflash_jax.cli.spec import app

        return app, ["plan"]


def invoke(*args: str):
    app, prefix = _app_and_prefix()
    return runner.invoke(app, [*prefix, *args])


def flat(text: str) -> str:
    """Output with rich's box characters removed and whitespace collapsed (panels wrap long lines)."""
    return re.sub(r"\s+", " ", re.sub(r"[│╭╮╰╯─]", " ", text)).strip()


def plan_json(*args: str) -> dict:
    result = invoke(*args, "--json")
    assert result.exit_code == 0, result.output
    return json.loads(result.output)


def test_the_worked_example_table():
    result = invoke("--cost", "0:32,1:44,2:50,3:56,4:62", "--acceptance", "0.611,0.312,0.117,0.028")
    assert result.exit_code == 0, result.output
    rows = {
        int(m.group(1)): (float(m.group(2)), float(m.group(3)), float(m.group(4)))
        for m in re.finditer(r"│\s*(\d+)\s*│\s*([\d.]+)\s*│\s*([\d.]+)\s*│\s*([\d.]+)\s*│", result.output)
    }
    assert rows == {
        0: (1.0, 32, 0.03125),
        1: (1.611, 44, 0.03661),
        2: (1.923, 50, 0.03846),
        3: (2.040, 56, 0.03643),
        4: (2.068, 62, 0.03335),
    }
    chosen_lines = [line for line in result.output.splitlines() if "<- chosen" in line]
    assert len(chosen_lines) == 1 and re.search(r"│\s*2\s*│", chosen_lines[0])
    assert "choice: 2 drafts" in result.output


def test_the_worked_example_as_json():
    doc = plan_json("--cost", "0:32,1:44,2:50,3:56,4:62", "--acceptance", "0.611,0.312,0.117,0.028")
    assert [r["drafts"] for r in doc["rows"]] == [0, 1, 2, 3, 4]
    assert [r["expected_tokens"] for r in doc["rows"]] == pytest.approx([1, 1.611, 1.923, 2.040, 2.068])
    assert [r["cost_ms"] for r in doc["rows"]] == [32, 44, 50, 56, 62]
    assert doc["choice"] == 2 and doc["top"] == 4


@pytest.mark.parametrize(
    "cost, rates, extra, choice, top",
    [
        ("0:32,1:44,2:50,3:56,4:62", "0.2", ["--conditional"], 0, 4),  # flat 0.2: plain decode
        ("1:44,2:50,3:56,4:62", "0.2", ["--conditional"], 1, 4),  # no 0: entry
        ("0:32,1:44,2:50,3:56,4:62", "0.95", ["--conditional"], 4, 4),  # capped at the widest priced depth
        ("0:32,1:44,2:50,3:56,4:62", "0.95", ["--conditional", "--cap", "3"], 3, 3),
        ("0:32,1:44;4=0:40,1:50,2:55", "0.9,0.81", ["--width", "4"], 2, 2),
    ],
)
def test_choices(cost, rates, extra, choice, top):
    doc = plan_json("--cost", cost, "--acceptance", rates, *extra)
    assert doc["choice"] == choice and doc["top"] == top
    assert [r["drafts"] for r in doc["rows"]][-1] == top


def test_a_suspending_plan_says_so():
    result = invoke("--cost", "0:32,1:44", "--acceptance", "0.1")
    assert result.exit_code == 0
    assert "choice: 0 drafts (plain decode" in flat(result.output)


@pytest.mark.parametrize(
    "args, flag, fragment",
    [
        (["--cost", "0:32,1", "--acceptance", "0.5"], "--cost", "is not drafts:ms"),
        (["--cost", "0:32", "--acceptance", "0.5"], "--cost", "prices no draft count >= 1"),
        (["--cost", "0:32,2:50", "--acceptance", "0.5"], "--cost", "draft counts must be consecutive"),
        (["--cost", "0:32,1:0", "--acceptance", "0.5"], "--cost", "the cost must be positive"),
        (["--cost", "0:32,1:44", "--acceptance", "0.5,x"], "--acceptance", "is not a marginal acceptance rate"),
        (["--cost", "0:32,1:44", "--acceptance", "1.2"], "--acceptance", "outside [0, 1]"),
        (["--cost", "0:32,1:44", "--acceptance", "0.3,0.6"], "--acceptance", "must not increase"),
        (["--cost", "0:32,1:44", "--acceptance", "0.5", "--cap", "0"], "--cap", ""),
    ],
)
def test_bad_flags_are_typer_errors_without_a_traceback(args, flag, fragment):
    result = invoke(*args)
    assert result.exit_code == 2
    assert isinstance(result.exception, SystemExit)
    text = flat(result.output)
    assert f"Invalid value for '{flag}'" in text
    assert fragment in text
    assert "Traceback" not in result.output
