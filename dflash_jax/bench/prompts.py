"""Benchmark prompts: the held-out set that ships with the package, and JSON Lines prompt files.

A prompt file has one JSON object per line with exactly one of `"prompt"` (raw text) or `"messages"` (a chat,
rendered with the model's chat template). The held-out set (`assets/prompts/heldout.jsonl`) is what `bench
decode` uses by default. The workload categories (`assets/prompts/<category>.jsonl`, `bench decode --category`)
are held out too: chat/prose, code, edit (the answer repeats or transforms text of the prompt) and structured
(JSON, tables, lists, formats). No training prompt is taken from any of them, nor any text of theirs
(`tests/train/test_copy_data.py` checks the training prompt sources).
"""

from __future__ import annotations

import json
from importlib import resources
from importlib.resources.abc import Traversable
from pathlib import Path

from dflash_jax.errors import UserError

PROMPTS_DIR: Traversable = resources.files("dflash_jax") / "assets" / "prompts"
HELDOUT_PROMPTS: Traversable = PROMPTS_DIR / "heldout.jsonl"
CATEGORIES: tuple[str, ...] = ("chat", "code", "edit", "structured")


def category_names(value: str) -> list[str]:
    """`--category` value: one category, a comma-separated list, or `all`; an unknown name is refused."""
    names = list(CATEGORIES) if value.strip() == "all" else [v.strip() for v in value.split(",") if v.strip()]
    bad = [n for n in names if n not in CATEGORIES]
    if bad or not names:
        raise UserError(
            f"--category {value!r}: unknown category {', '.join(bad) or '(none)'}; use one or more of "
            f"{', '.join(CATEGORIES)} (comma-separated) or all",
            param="--category",
        )
    return names


def load_category(name: str) -> list[dict]:
    """The held-out prompts of one workload category."""
    category_names(name)
    return _parse(PROMPTS_DIR.joinpath(f"{name}.jsonl").read_text(encoding="utf-8"), f"{name}.jsonl")


def interleave_categories(value: str) -> list[dict]:
    """The prompts of the `--category` value's categories taken in turn (a mixed workload: `edit,chat` gives edit 1,
    chat 1, edit 2, chat 2, ...; a category that runs out drops out). Each prompt gets a `category` field."""
    lists = [[{**r, "category": n} for r in load_category(n)] for n in category_names(value)]
    return [lst[i] for i in range(max(len(lst) for lst in lists)) for lst in lists if i < len(lst)]


def load_prompt_file(path: str | Path | None = None) -> list[dict]:
    """The prompts of a JSON Lines file (None: the held-out set); errors name `--prompts` and the line."""
    if path is None:
        text, name = HELDOUT_PROMPTS.read_text(encoding="utf-8"), "heldout.jsonl"
    else:
        if not Path(path).exists():
            raise UserError(f"--prompts {path}: no such file", param="--prompts")
        text, name = Path(path).read_text(encoding="utf-8"), str(path)
    return _parse(text, name)


def _parse(text: str, name: str) -> list[dict]:
    out = []
    for i, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise UserError(f"--prompts {name}:{i}: not valid JSON ({e.msg})", param="--prompts") from None
        if not isinstance(obj, dict) or ("prompt" in obj) == ("messages" in obj):
            raise UserError(f'--prompts {name}:{i}: needs exactly one of "prompt" or "messages"', param="--prompts")
        out.append(obj)
    if not out:
        raise UserError(f"--prompts {name}: the file has no prompts", param="--prompts")
    return out


def heldout_user_messages() -> set[str]:
    """The user messages of the held-out prompts and of every workload category (training data must not contain
    them)."""
    rows = load_prompt_file(None) + [r for c in CATEGORIES for r in load_category(c)]
    return {m["content"].strip() for r in rows for m in r.get("messages", []) if m.get("role") == "user"}


def encode_prompts(tok, prompts: list[dict]) -> list[list[int]]:
    """Token ids of each prompt (`messages` through the chat template)."""
    return [tok.encode_chat(p["messages"]) if "messages" in p else tok.encode(p["prompt"]) for p in prompts]
