"""Copy-heavy training prompts (`train data --copy-fraction/--edit-turn-fraction`): the held-out workload
categories share no text with any training prompt source; formats render to what a parser reads back; two-turn
rows carry the target's own first answer; build_dataset mixes copy prompts with the families."""

from __future__ import annotations

import csv
import io
import json
import random
import re

import numpy as np
import pytest

from dflash_jax.bench.prompts import CATEGORIES, heldout_user_messages, load_category, load_prompt_file
from dflash_jax.train import copy_prompts as copy_mod
from dflash_jax.train import data as data_mod
from dflash_jax.train import prompts as prompts_mod
from dflash_jax.train.data import DataConfig, build_dataset, copy_prompts, generate_shard
from tests.train.test_train_self_prompts import EOS, _lt

N = 8  # words: no run of this many held-out words may appear in a training source


def _ngrams(text: str, n: int = N) -> set[tuple[str, ...]]:
    words = re.findall(r"[a-z0-9_]+", text.lower())
    return {tuple(words[i : i + n]) for i in range(len(words) - n + 1)}


def test_categories_ship_enough_prompts_and_are_excluded_from_training():
    held = heldout_user_messages()
    for c in CATEGORIES:
        rows = load_category(c)
        assert len(rows) >= 12, c
        assert {r["messages"][0]["content"].strip() for r in rows} <= held
    assert {r["messages"][0]["content"].strip() for r in load_prompt_file(None)} <= held


def test_heldout_prompts_share_no_long_ngram_with_any_training_source(tmp_path, monkeypatch):
    monkeypatch.setattr(prompts_mod, "_shakespeare_passages", lambda *a: [])  # no download in tests
    monkeypatch.setattr(copy_mod, "_shakespeare_passages", lambda *a: [])
    held = set()  # the workload categories; the mixed held-out set is checked for exact prompts (test_train.py)
    for c in CATEGORIES:
        for r in load_category(c):
            held |= _ngrams(r["messages"][0]["content"])
    sources = []
    for seed in range(3):
        sources += [m[0]["content"] for m in prompts_mod.build_prompts(300, seed=seed, cache_dir=tmp_path)]
        sources += [m[0]["content"] for m in copy_mod.build_copy_prompts(300, seed=seed, cache_dir=tmp_path)]
    funcs, docs = copy_mod._stdlib_units()
    sources += list(funcs) + list(docs)
    for mod in (prompts_mod, copy_mod):  # every template and word list, whether or not a draw above used it
        sources += [json.dumps(v, default=str) for k, v in vars(mod).items() if k.isupper()]
    rng = random.Random(0)
    sources += [copy_mod.follow_up(f"```python\ndef f{i}(x):\n```", rng) for i in range(50)]
    sources += [copy_mod.follow_up("A plain answer.", rng) for _ in range(50)]
    shared = {g for s in sources for g in _ngrams(s) & held}
    assert held and not shared, sorted(shared)[:5]


def test_records_render_to_what_parsers_read_back():
    header, rows = ["name", "city", "age"], [["Ada", "Lima", "31"], ["Kofi", "Cork", "77"]]
    assert json.loads(copy_mod.render("JSON", header, rows)) == [dict(zip(header, r, strict=True)) for r in rows]
    assert list(csv.reader(io.StringIO(copy_mod.render("CSV", header, rows)))) == [header, *rows]
    md = copy_mod.render("Markdown table", header, rows).splitlines()
    assert md[0] == "| name | city | age |" and md[1] == "|---|---|---|" and md[3] == "| Kofi | Cork | 77 |"
    assert copy_mod.render("YAML", header, rows).splitlines()[:3] == ["- name: Ada", "  city: Lima", "  age: 31"]


def test_add_typos_misspells_words_and_keeps_the_rest():
    text = "Return the smallest element of the sequence, or raise ValueError when it is empty."
    bad = copy_mod.add_typos(text, random.Random(1), n=3)
    a, b = text.split(), bad.split()
    changed = [(x, y) for x, y in zip(a, b, strict=True) if x != y]
    assert 1 <= len(changed) <= 3
    assert all(sorted(x) == sorted(y) or len(y) == len(x) - 1 for x, y in changed)


def _fake_sources(monkeypatch):
    monkeypatch.setattr(
        data_mod, "build_prompts", lambda n, seed: [[{"role": "user", "content": f"fam{i}"}] for i in range(n)]
    )
    monkeypatch.setattr(
        data_mod,
        "build_copy_prompts",
        lambda n, seed: [[{"role": "user", "content": f"copy{seed}x{i}"}] for i in range(n)],
    )


def test_two_turn_rows_carry_the_targets_own_first_answer(monkeypatch):
    _fake_sources(monkeypatch)
    lt = _lt()
    cfg = DataConfig(taps=(), max_prompt=120, seed=5, edit_turn_fraction=0.5)
    got, n_two = copy_prompts(lt, cfg, 6, shard=1)
    assert (got, n_two) == copy_prompts(lt, cfg, 6, shard=1)  # deterministic for (seed, shard)
    assert len(got) == 6 and 1 <= n_two <= 3
    # the reference: the first answers, generated greedily by hand from the same first prompts
    firsts = data_mod.build_prompts(3, seed=5 * 7_001 + 1) + data_mod.build_copy_prompts(3, seed=5 * 7_003 + 1)
    random.Random(5 * 1_000_033 + 1).shuffle(firsts)
    firsts = firsts[:3]
    gen = DataConfig(taps=(), max_prompt=60, max_new=28, sampled_fraction=0.0, seed=5 + 2_000_003, store_taps=False)
    rows = generate_shard(lt, gen, [lt.tokenizer.encode_chat(m) for m in firsts], 1)
    answers = []
    for m, toks, n in zip(firsts, rows["tokens"], rows["lengths"], strict=True):
        p = lt.tokenizer.encode_chat(m)
        ans = [int(t) for t in toks[len(p) : n]]
        if ans and ans[-1] in lt.tokenizer.eos_token_ids:
            answers.append((p, lt.tokenizer.encode(lt.tokenizer.decode(ans[:-1]).strip())))
    assert len(answers) >= n_two
    for ids in got[:n_two]:
        assert ids.count(EOS) == 3  # user, assistant (the target's answer), user
        assert any(ids[: len(p) - 1] == p[:-1] and ids[len(p) : len(p) + len(a)] == a for p, a in answers)
    for ids in got[n_two:]:
        assert ids.count(EOS) == 1
    # an excluded message never comes back
    single = DataConfig(taps=(), max_prompt=120, seed=5)
    plain, _ = copy_prompts(lt, single, 3, shard=0)
    excl, _ = copy_prompts(lt, single, 3, shard=0, exclude={f"copy{(5 * 1_009) * 16}x0"})
    assert plain[0] not in excl and excl[0] == plain[1]


def test_build_dataset_mixes_copy_and_family_prompts(tmp_path, monkeypatch):
    _fake_sources(monkeypatch)
    lt = _lt()
    cfg = DataConfig(taps=(1,), num_shards=1, rows_per_shard=4, max_prompt=40, max_new=6, copy_fraction=0.5, seed=3)
    build_dataset(lt, cfg, tmp_path)
    shard = np.load(tmp_path / "shard_00000.npz")
    own, _ = copy_prompts(lt, cfg, 2, shard=0)
    fam = [lt.tokenizer.encode_chat([{"role": "user", "content": f"fam{i}"}]) for i in range(2)]
    for row, mask, prompt in zip(shard["tokens"], shard["loss_mask"], own + fam, strict=True):
        assert list(row[: len(prompt)]) == prompt and mask[: len(prompt)].sum() == 0
    assert shard["loss_mask"].sum() > 0


def test_train_data_refuses_more_than_all_rows(tmp_path):
    from typer.testing import CliRunner

    from dflash_jax.cli.main import app
    from tests.checkpoints.test_loading_errors import write_model

    model = write_model(tmp_path / "t")
    args = ["train", "data", "--model", str(model), "--out", str(tmp_path / "d"), "--num-shards", "1"]
    res = CliRunner().invoke(app, [*args, "--copy-fraction", "0.7", "--self-prompt-fraction", "0.5"])
    assert res.exit_code != 0 and "--copy-fraction" in res.output and not (tmp_path / "d").exists()


@pytest.mark.parametrize("value", ["all", "edit,code", "chat"])
def test_category_names(value):
    from dflash_jax.bench.prompts import category_names

    names = category_names(value)
    assert names == (list(CATEGORIES) if value == "all" else value.split(","))


def _kinds_prompts(n=400, seed=7):
    return [m[0]["content"] for m in copy_mod.build_copy_prompts(n, seed=seed, cache_dir=None)]


@pytest.fixture
def no_shakespeare(monkeypatch):
    monkeypatch.setattr(copy_mod, "_shakespeare_passages", lambda *a: [])


def test_copy_prompts_are_deterministic_by_seed_and_cover_every_family(no_shakespeare):
    a, b, c = _kinds_prompts(seed=7), _kinds_prompts(seed=7), _kinds_prompts(seed=8)
    assert a == b and a != c and len(a) == 400
    heads = [p.split("\n")[0] for p in a]
    code_heads = {t.split("`")[0] for t in copy_mod.CODE_TASKS}
    assert any(h.startswith(tuple(code_heads)) for h in heads)
    assert any(p.startswith(tuple(t.split("`")[0] for t in copy_mod.VAR_TASKS)) for p in a)  # variable renames
    assert any(p.startswith(("Write a Python function `", "Implement `")) for p in a)  # written from a docstring
    assert any(p.startswith(tuple(t.split("{")[0] for t in copy_mod.PATTERN_TASKS)) for p in a)
    assert any(p.startswith(tuple(t.split("{")[0] for t in copy_mod.SHORT_TASKS)) for p in a)
    assert any(p.startswith("Write these details as a ") for p in a)
    assert any(p.startswith("Rewrite this ") and " as a " in heads[a.index(p)] for p in a)


def test_variable_rename_names_a_variable_the_code_assigns(no_shakespeare):
    src = "def total(prices):\n    acc = 0\n    for p in prices:\n        acc += p\n    return acc"
    assert copy_mod._assigned_names(src) == ["acc"]  # one-letter names and parameters are not renamed
    for seed in range(20):
        prompt = copy_mod._var_prompt(random.Random(seed), src)
        names = re.findall(r"`(\w+)`", prompt.split("\n")[0])
        old, new = names[::-1] if prompt.startswith("Use the name") else names
        assert old == "acc" and new != "acc" and "acc" in new
        assert prompt.endswith(f"```python\n{src}\n```")


def test_function_specs_come_from_real_stdlib_functions():
    import sysconfig
    from pathlib import Path

    _, _, specs = copy_mod._stdlib_walk()
    assert len(specs) > 50
    texts = [p.read_text(errors="replace") for p in Path(sysconfig.get_paths()["stdlib"]).glob("*.py")]
    for name, args, summary in random.Random(0).sample(specs, 10):
        assert summary.endswith(".") and "\n" not in summary and 20 <= len(summary) <= 160
        assert not name.startswith("_") and "self" not in args
        head = summary.split()[:4]
        # a stdlib file defines the function, with its docstring opening on the summary's first words
        assert any(
            re.search(
                rf"def {name}\(.*?:\s*\n\s*[rRuU]?(\"\"\"|\'\'\')\s*" + r"\s+".join(map(re.escape, head)), t, re.S
            )
            for t in texts
            if f"def {name}(" in t
        ), name


def test_summary_takes_the_first_sentence_only():
    assert copy_mod._summary("Return the sum of the values.\n\nMore text here.") == "Return the sum of the values."
    assert copy_mod._summary("Split the pathname path into a pair. More details follow.") == (
        "Split the pathname path into a pair."
    )
    assert copy_mod._summary("x") == "" and copy_mod._summary(">>> f(1)\n1") == ""


def test_pattern_and_list_prompts_render_their_data():
    for seed in range(30):
        rng = random.Random(seed)
        lines = copy_mod._pattern_lines(rng)
        assert 3 <= len(lines) <= 5 and len(set(lines)) == len(lines)
    items = ["apple", "river", "candle"]
    assert json.loads(copy_mod._list_as("JSON array of strings", items)) == items
    assert copy_mod._list_as("numbered list", items).splitlines() == ["1. apple", "2. river", "3. candle"]
    assert copy_mod._list_as("comma-separated line", items) == "apple, river, candle"
    assert copy_mod._list_as("bulleted list", items).splitlines()[2] == "- candle"


def test_short_edits_act_on_words_of_their_text():
    text = "Return the number of items that match the pattern given by the caller."
    for seed in range(40):
        prompt = copy_mod._short_prompt(random.Random(seed), text)
        head, body = prompt.split("\n", 1)
        if head.startswith("Swap every"):
            word = re.findall(r"'(\w+)'", head)[0]
            assert re.search(rf"\b{word}\b", body)
        if "spelling" in head:
            assert body != text and sorted(body.split()) != sorted(text.split())
        else:
            assert body == text


def test_follow_up_renames_a_variable_of_the_targets_code():
    answer = "Here it is:\n```python\ndef mean(xs):\n    total = sum(xs)\n    return total / len(xs)\n```"
    asks = {copy_mod.follow_up(answer, random.Random(s)) for s in range(60)}
    renames = [a for a in asks if "`total`" in a]
    assert renames and all(re.search(r"`total` (to|called) `\w*total\w*`", a) for a in renames)
    plain = {copy_mod.follow_up("Bees make honey from nectar.", random.Random(s)) for s in range(60)}
    assert not any("`" in a for a in plain)
