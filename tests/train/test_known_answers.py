"""Teacher-forced copy data (`train copy-data`): the exact answers of the tasks, against hand-worked results and
parsers; the loss mask against the target's own greedy generation (a row whose answer is the target's greedy
output is kept whole, a changed token is dropped); the taps against those the generator stores; held-out text
never used; resumable shards and flag errors."""

from __future__ import annotations

import ast
import csv
import io
import json
import random
import re

import numpy as np
import pytest

from dflash_jax.bench.prompts import CATEGORIES, load_category
from dflash_jax.errors import UserError
from dflash_jax.train import known_answers as known
from dflash_jax.train.data import DataConfig, generate_shard
from dflash_jax.train.trainer import ShardData
from tests.train.test_copy_data import _ngrams
from tests.train.test_train_self_prompts import _lt

SRC = '''def scale(values, factor=2):
    """Multiply every value."""
    result = []
    for item in values:
        result.append(item * factor)
    return result'''


@pytest.mark.parametrize(
    ("op", "want"),
    [
        ("copy", "One cat. Two dogs!\nThe end"),
        ("typos", "One cat. Two dogs!\nThe end"),
        ("upper", "ONE CAT. TWO DOGS!\nTHE END"),
        ("swap", "One bird. Two dogs!\nThe end"),
        ("lines", "One cat.\nTwo dogs!\nThe end"),
        ("bullets", "- One cat.\n- Two dogs!\n- The end"),
        ("numbered", "1. One cat. Two dogs!\n2. The end"),
        ("quoted", '"One cat. Two dogs!\nThe end"'),
        ("quote_lines", "> One cat. Two dogs!\n> The end"),
    ],
)
def test_prose_answers_are_the_worked_results(op, want):
    assert known._prose_answer(op, "One cat. Two dogs!\nThe end", "cat", "bird") == want


def test_prose_tasks_show_the_text_and_answer_it():
    rng = random.Random(0)
    for _ in range(200):
        t = known.prose_task(rng, "The quick brown fox jumps over the lazy dog. Then it sleeps.")
        prompt = t.messages[0]["content"]
        if "typos" in prompt or "spelling" in prompt:
            assert t.answer == "The quick brown fox jumps over the lazy dog. Then it sleeps."
            assert t.answer not in prompt  # the prompt shows the misspelt text
        elif "capital" in prompt:
            assert t.answer == t.answer.upper() and t.answer.lower() in prompt.lower()
        m = re.search(r"'(\w+)' for '(\w+)'|every '(\w+)' in the text below with '(\w+)'", prompt)
        if m:
            word, other = (m.group(1), m.group(2)) if m.group(1) else (m.group(3), m.group(4))
            assert not re.search(rf"\b{word}\b", t.answer) and re.search(rf"\b{other}\b", t.answer)


def test_code_answers_parse_and_apply_the_edit():
    rng = random.Random(1)
    seen = set()
    for _ in range(300):
        t = known.code_task(rng, SRC)
        prompt = t.messages[0]["content"]
        assert t.answer.startswith("```python\n") and t.answer.endswith("\n```")
        code = t.answer.removeprefix("```python\n").removesuffix("\n```")
        ast.parse(textwrap_dedent(code))
        names = {n.id for n in ast.walk(ast.parse(textwrap_dedent(code))) if isinstance(n, ast.Name)}
        m = re.search(r"`(\w+)` to `(\w+)`|`(\w+)` instead of `(\w+)`", prompt)
        if m:
            old, new = (m.group(1), m.group(2)) if m.group(1) else (m.group(4), m.group(3))
            defs = {n.name for n in ast.walk(ast.parse(code)) if isinstance(n, ast.FunctionDef)}
            args = {a.arg for n in ast.walk(ast.parse(code)) if isinstance(n, ast.FunctionDef) for a in n.args.args}
            assert old not in names | defs | args and new in names | defs | args, (prompt, code)
            seen.add("rename")
        elif "typos" in prompt:
            assert code == SRC and SRC not in prompt
            seen.add("typos")
        elif "indentation" in prompt:
            assert code.splitlines() == ["    " + ln for ln in SRC.splitlines()]
            seen.add("indent")
        else:
            assert code == SRC and SRC in prompt
            seen.add("copy")
    assert seen == {"rename", "typos", "indent", "copy"}


def textwrap_dedent(code: str) -> str:
    import textwrap

    return textwrap.dedent(code)


def _parse_csv(text: str) -> list[list[str]]:
    return [r for r in csv.reader(io.StringIO(text))]


def _count(word: str, text: str) -> int:
    return len(re.findall(rf"\b{re.escape(word)}\b", text))


def test_record_answers_read_back_as_the_records():
    rng = random.Random(2)
    kinds = set()
    for _ in range(300):
        t = known.records_task(rng)
        prompt = t.messages[0]["content"]
        if "from CSV to JSON" in prompt:
            rows = _parse_csv(prompt.split("\n\n", 1)[1])
            got = json.loads(t.answer)
            assert [list(d.values()) for d in got] == rows[1:] and list(got[0]) == rows[0]
            kinds.add("convert")
        elif "Sort these records by" in prompt and "CSV form" in prompt:
            field = re.search(r"by (\w+)", prompt).group(1)
            before, after = _parse_csv(prompt.split("\n\n", 1)[1]), _parse_csv(t.answer)
            k = before[0].index(field)
            keys = [known._sort_key(r[k]) for r in after[1:]]
            assert keys == sorted(keys) and sorted(map(tuple, after[1:])) == sorted(map(tuple, before[1:]))
            kinds.add("sort")
        elif "Delete the row for" in prompt:
            who = re.search(r"row for (.+?) from", prompt).group(1)
            data = prompt.split("\n\n", 1)[1]
            assert _count(who, t.answer) == _count(who, data) - 1
            kinds.add("delete")
        elif "exactly, in the same format" in prompt:
            assert prompt.endswith(t.answer)
            kinds.add("same")
    assert kinds == {"convert", "sort", "delete", "same"}


def test_list_answers_hold_the_same_items():
    rng = random.Random(3)
    for _ in range(50):
        t = known.list_task(rng)
        words = re.findall(r"[a-z]+", t.messages[0]["content"].split(":", 1)[1])
        assert re.findall(r"[a-z]+", t.answer) == words


def test_heldout_prompts_share_no_long_ngram_with_the_tasks(tmp_path, monkeypatch):
    monkeypatch.setattr(known, "_shakespeare_passages", lambda *a: [])  # no download in tests
    held = set()
    for c in CATEGORIES:
        for r in load_category(c):
            held |= _ngrams(r["messages"][0]["content"])
    sources = []
    for seed in range(3):
        for t in known.build_known_tasks(300, seed=seed, cache_dir=tmp_path):
            sources += [t.messages[0]["content"], t.answer]
    sources += [json.dumps(v, default=str) for k, v in vars(known).items() if k.isupper()]
    shared = {g for s in sources for g in _ngrams(s) & held}
    assert held and not shared, sorted(shared)[:5]


def test_build_known_tasks_is_deterministic_and_uses_earlier_answers(monkeypatch, tmp_path):
    monkeypatch.setattr(known, "_shakespeare_passages", lambda *a: [])
    a = known.build_known_tasks(40, seed=5, earlier=["Paris is the capital of France. It is big."], cache_dir=tmp_path)
    b = known.build_known_tasks(40, seed=5, earlier=["Paris is the capital of France. It is big."], cache_dir=tmp_path)
    assert a == b and len(a) == 40
    assert any("Paris" in t.messages[0]["content"] for t in a)


def _greedy_rows(lt, prompts, taps):
    cfg = DataConfig(taps=taps, max_prompt=12, max_new=24, sampled_fraction=0.0, store_taps=True)
    return generate_shard(lt, cfg, prompts, 0)


def test_the_targets_greedy_answer_is_kept_whole_and_a_changed_token_is_dropped():
    lt = _lt()
    prompts = [lt.tokenizer.encode_chat([{"role": "user", "content": w}]) for w in ("abc", "hello", "xyzzy")]
    taps = (1, 3)
    gen = _greedy_rows(lt, prompts, taps)
    rows = [(list(gen["tokens"][i, : gen["lengths"][i]]), len(p)) for i, p in enumerate(prompts)]
    assert all(len(ids) > start + 3 for ids, start in rows)
    arrays, stats = known.teacher_forced_shard(lt, rows, taps, 36)
    for i, (ids, start) in enumerate(rows):
        assert arrays["loss_mask"][i, :start].sum() == 0
        assert arrays["loss_mask"][i, start : len(ids)].all()  # every answer token is the target's argmax
        assert arrays["loss_mask"][i, len(ids) :].sum() == 0
        np.testing.assert_allclose(
            arrays["taps"][i, : len(ids)].astype(np.float32),
            gen["taps"][i, : len(ids)].astype(np.float32),
            atol=2e-2,
            rtol=2e-2,
        )
    assert stats["kept"] == 1.0 and stats["rows"] == 3

    ids, start = rows[0]
    k = start + 2
    changed = [*ids[:k], (ids[k] + 1) % 45, *ids[k + 1 :]]
    arrays, stats = known.teacher_forced_shard(lt, [(changed, start)], taps, 36)
    assert arrays["loss_mask"][0, start:k].all() and arrays["loss_mask"][0, k] == 0
    assert stats["kept"] < 1.0


def test_task_rows_cut_long_answers_drop_long_prompts_and_held_out_ones():
    lt = _lt()
    tasks = [
        known.KnownTask([{"role": "user", "content": "ab"}], "c" * 100, "prose"),
        known.KnownTask([{"role": "user", "content": "x" * 60}], "cd", "prose"),
        known.KnownTask([{"role": "user", "content": "held"}], "cd", "prose"),
    ]
    rows = known.task_rows(lt, tasks, 40, exclude={"held"})
    assert len(rows) == 1
    ids, start = rows[0]
    assert len(ids) == 40 and ids[:start] == lt.tokenizer.encode_chat(tasks[0].messages)


def test_dataset_resumes_and_refuses_other_settings(tmp_path, monkeypatch):
    monkeypatch.setattr(known, "_shakespeare_passages", lambda *a: [])
    monkeypatch.setattr(known, "_stdlib_walk", lambda: ((SRC,), ("Return the sum. It is fast.",), ()))
    lt = _lt()
    kw = dict(taps=(1, 3), num_shards=2, rows_per_shard=3, seq_len=64, seed=1)
    monkeypatch.setattr(known, "task_rows", lambda lt, tasks, n, ex: [([1, 2, 3, 4, 5, 6, 7, 8], 3)] * 5)
    stats = known.build_known_dataset(lt, tmp_path / "d", **kw)
    assert [s["rows"] for s in stats] == [3, 3]
    assert known.build_known_dataset(lt, tmp_path / "d", **kw) == []  # resumed: nothing left to write
    meta = json.loads((tmp_path / "d" / "data.json").read_text())
    assert meta["config"]["taps"] == [1, 3]
    data = ShardData(sorted((tmp_path / "d").glob("shard_*.npz")))
    assert len(data) == 6 and data.taps.shape == (6, 64, 2 * lt.cfg.hidden_size)
    with pytest.raises(UserError, match="other settings"):
        known.build_known_dataset(lt, tmp_path / "d", **{**kw, "seed": 2})


def test_copy_data_flag_errors(tmp_path):
    from typer.testing import CliRunner

    from dflash_jax.cli.main import app

    res = CliRunner().invoke(
        app, ["train", "copy-data", "--out", str(tmp_path / "d"), "--earlier-answers", str(tmp_path / "none")]
    )
    assert res.exit_code != 0 and "--earlier-answers" in res.output and not (tmp_path / "d").exists()
