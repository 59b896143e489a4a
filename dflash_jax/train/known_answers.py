"""Copy tasks whose answer is known exactly, and teacher-forced training rows built from them.

A task here is a prompt (from the same sources and task families as `train.copy_prompts`: standard-library code and
docstrings, Shakespeare passages, generated records, and, when given, the target's own earlier answers) together
with the text a faithful answer is: the code with the name replaced, the passage with its typos undone, the records
in the other format. Such an answer needs no generation: one teacher-forced forward of the target over
prompt + answer gives the taps at every position and the target's greedy next token at every position, where
generating it would take one decode step per token.

Only the positions the target itself would produce are trained on: the loss mask of a row is 1 on an answer token
when it equals the target's argmax after the tokens before it. A drafter block that starts at an anchor is right up
to the first token the target would not emit, so those labels are exactly the ones a greedy verification accepts;
where the target words things its own way (a preface, a paraphrase), the row conditions on the given answer and the
loss skips those tokens. The share of answer tokens kept is reported per shard (how closely the target copies).
"""

from __future__ import annotations

import json
import random
import re
import textwrap
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dflash_jax.checkpoints.loader import LoadedTarget
from dflash_jax.errors import UserError
from dflash_jax.models.layers import contiguous_pages
from dflash_jax.models.target import init_kv_cache
from dflash_jax.train.copy_prompts import (
    FORMATS,
    LIST_TASKS,
    LIST_WORDS,
    _assigned_names,
    _identifier_typos,
    _list_as,
    _present_word,
    _records_of,
    _renamed,
    _short_text,
    _stdlib_walk,
    add_typos,
    render,
)
from dflash_jax.train.prompts import _shakespeare_passages

PAGE_SIZE = 16
BUCKETS = (128, 256, 384, 512, 768, 1024)  # row lengths of the teacher-forced forward (a compile each)
TOKENS_PER_CALL = 4096  # rows per forward call = this // bucket

CODE = [
    ("Copy this code exactly as it is into a Python code block:", "copy"),
    ("Rename the function `{name}` to `{new}` and print the complete code again:", "rename"),
    ("Please rename the function `{name}` to `{new}` everywhere below and show the code:", "rename"),
    ("Change the name of the parameter `{param}` to `{new_param}` everywhere in the code below:", "param"),
    ("Use the name `{new_var}` instead of `{var}` in the code below and show every line of it:", "var"),
    ("Please rename `{var}` to `{new_var}` throughout this snippet and print the result:", "var"),
    ("Some identifiers in this code contain typos. Correct them and give back the whole snippet:", "typos"),
    ("Write this code again with four extra spaces of indentation on every line:", "indent"),
    ("Repeat this function back to me without any changes:", "copy"),
]  # fmt: skip
PROSE = [
    ("Correct the typos in the text below. Answer with the corrected text and nothing else.", "typos"),
    ("There are spelling errors in the text below. Write it out again with them fixed, nothing more.", "typos"),
    ("Say this back to me word for word:", "copy"),
    ("Echo the text below back to me exactly as written:", "copy"),
    ("Write this passage again in capital letters:", "upper"),
    ("Swap the word '{word}' for '{other}' everywhere in this passage and give me the result:", "swap"),
    ("Replace every '{word}' in the text below with '{other}', and show the changed text:", "swap"),
    ("Put every sentence of this text on a line of its own:", "lines"),
    ("Turn the text into a list of bullet points, one per sentence:", "bullets"),
    ("Number the lines of this text, starting from 1:", "numbered"),
    ("Wrap this text in double quotation marks and repeat it:", "quoted"),
    ("Repeat the text below with '> ' at the start of every line:", "quote_lines"),
]  # fmt: skip
RECORDS = [
    ("Convert the data below from {src} to {dst}:", "convert"),
    ("Rewrite these records in {dst} form, keeping every value:", "convert"),
    ("Give me the same data in {dst} form, with the fields in the same order:", "convert"),
    ("Sort these records by {field} and give them back in {src} form:", "sort"),
    ("In the data below, change the {field} of the row for {who} to {val}. Give back all of it:", "set"),
    ("Delete the row for {who} from this data and show what is left, in the same format:", "delete"),
    ("Repeat this data exactly, in the same format:", "same"),
]  # fmt: skip
KINDS = ["code", "prose", "short", "records", "list", "earlier"]
WEIGHTS = [0.3, 0.2, 0.15, 0.15, 0.05, 0.15]


@dataclass(frozen=True)
class KnownTask:
    messages: list[dict[str, str]]
    answer: str
    kind: str


def _sentences(text: str) -> list[str]:
    return [s for s in re.split(r"(?<=[.!?;:])\s+", " ".join(text.split())) if s]


def _prose_answer(op: str, text: str, word: str, other: str) -> str:
    if op in ("copy", "typos"):
        return text
    if op == "upper":
        return text.upper()
    if op == "swap":
        return re.sub(rf"\b{re.escape(word)}\b", other, text)
    if op == "lines":
        return "\n".join(_sentences(text))
    if op == "bullets":
        return "\n".join(f"- {s}" for s in _sentences(text))
    if op == "numbered":
        return "\n".join(f"{i + 1}. {ln}" for i, ln in enumerate(text.splitlines()))
    if op == "quoted":
        return f'"{text}"'
    return "\n".join(f"> {ln}" for ln in text.splitlines())


def prose_task(rng: random.Random, text: str) -> KnownTask:
    """An edit of `text` (a passage, a docstring, an earlier answer) and its exact result."""
    head, op = rng.choice(PROSE)
    word, other = _present_word(text, rng)
    shown = add_typos(text, rng, n=rng.randint(2, 5)) if op == "typos" else text
    prompt = f"{head.format(word=word, other=other)}\n\n{shown}"
    return KnownTask([{"role": "user", "content": prompt}], _prose_answer(op, text, word, other), "prose")


def code_task(rng: random.Random, src: str) -> KnownTask:
    """An edit of a function's source and the edited source, in a Python code block."""
    m = re.match(r"\s*def (\w+)\(([^)]*)\)", src)
    name = m.group(1) if m else "f"
    params = [p.split(":")[0].split("=")[0].strip() for p in (m.group(2).split(",") if m else [])]
    params = [p for p in params if p and p not in ("self", "cls") and not p.startswith("*")]
    names = _assigned_names(src)
    head, op = rng.choice(CODE)
    if (op == "param" and not params) or (op == "var" and not names):
        head, op = CODE[1]
    param = rng.choice(params) if params else "x"
    var = rng.choice(names) if names else "x"
    new, new_param, new_var = _renamed(name, rng), _renamed(param, rng), _renamed(var, rng)
    shown, result = src, src
    if op == "rename":
        result = re.sub(rf"\b{name}\b", new, src)
    elif op == "param":
        result = re.sub(rf"\b{param}\b", new_param, src)
    elif op == "var":
        result = re.sub(rf"\b{var}\b", new_var, src)
    elif op == "typos":
        shown = _identifier_typos(src, rng)
    elif op == "indent":
        result = textwrap.indent(src, "    ")
    text = head.format(name=name, new=new, param=param, new_param=new_param, var=var, new_var=new_var)
    prompt = f"{text}\n```python\n{shown}\n```"
    return KnownTask([{"role": "user", "content": prompt}], f"```python\n{result}\n```", "code")


def _sort_key(v: str):
    try:
        return (0, float(v), "")
    except ValueError:
        return (1, 0.0, v)


def records_task(rng: random.Random) -> KnownTask:
    """A conversion or edit of generated records and the records it gives."""
    header, rows = _records_of(rng)
    src, dst = rng.sample(FORMATS, 2)
    head, op = rng.choice(RECORDS)
    field = rng.choice(header)
    row = rng.choice(rows)
    val = str(rng.randint(2, 99))
    out_fmt, out_rows = src, rows
    if op == "convert":
        out_fmt = dst
    elif op == "sort":
        k = header.index(field)
        out_rows = sorted(rows, key=lambda r: _sort_key(r[k]))
    elif op == "set":
        field = header[-1]
        out_rows = [[*r[:-1], val] if r is row else r for r in rows]
    elif op == "delete":
        out_rows = [r for r in rows if r is not row]
    text = head.format(src=src, dst=dst, field=field, who=row[0], val=val)
    prompt = f"{text}\n\n{render(src, header, rows)}"
    return KnownTask([{"role": "user", "content": prompt}], render(out_fmt, header, out_rows), "records")


def list_task(rng: random.Random) -> KnownTask:
    a, b = rng.choice(LIST_TASKS)
    items = rng.sample(LIST_WORDS, rng.randint(3, 7))
    prompt = f"Rewrite this {a} as a {b}:\n{_list_as(a, items)}"
    return KnownTask([{"role": "user", "content": prompt}], _list_as(b, items), "list")


def build_known_tasks(
    n: int, seed: int = 0, earlier: list[str] | tuple[str, ...] = (), cache_dir: Path = Path("data/cache")
) -> list[KnownTask]:
    """`n` tasks with exact answers, deterministic for (seed, earlier): `KINDS` with `WEIGHTS`; `earlier` (the
    target's own answers to other prompts) supplies the text of the `earlier` kind (without it, those tasks edit
    docstrings and passages instead)."""
    rng = random.Random(seed)
    funcs, docs, _ = _stdlib_walk()
    shakes = _shakespeare_passages(cache_dir, rng, n // 6 + 1)
    long_texts = list(docs) + shakes
    out: list[KnownTask] = []
    while len(out) < n:
        k = rng.choices(KINDS, WEIGHTS)[0]
        if k == "code" and funcs:
            out.append(code_task(rng, rng.choice(funcs)))
        elif k == "prose" and long_texts:
            out.append(prose_task(rng, rng.choice(shakes if shakes and rng.random() < 0.4 else long_texts)))
        elif k == "short" and (docs or shakes):
            out.append(prose_task(rng, _short_text(rng, docs, shakes)))
        elif k == "records":
            out.append(records_task(rng))
        elif k == "list":
            out.append(list_task(rng))
        elif k == "earlier" and (earlier or long_texts):
            text = rng.choice(earlier) if earlier else rng.choice(long_texts)
            out.append(prose_task(rng, text))
    return out


def end_of_turn(lt: LoadedTarget) -> int:
    """The token that closes an assistant turn in the target's chat template (its first EOS id that the template
    writes after a message)."""
    eos = lt.tokenizer.eos_token_ids
    ids = lt.tokenizer.encode_chat([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}])
    hits = [t for t in ids if t in eos]
    if hits:
        return hits[-1]
    if not eos:
        raise UserError(f"{lt.model_id}: the tokenizer names no EOS token, so an answer cannot be closed")
    return min(eos)


def task_rows(lt: LoadedTarget, tasks: list[KnownTask], max_len: int, exclude: set[str] = frozenset()):
    """(token ids, answer start) per task that fits `max_len` with at least 16 answer tokens (answers longer
    than what is left are cut); tasks whose user message is in `exclude` are dropped."""
    eot = end_of_turn(lt)
    out = []
    for t in tasks:
        if any(m["content"].strip() in exclude for m in t.messages if m["role"] == "user"):
            continue
        prompt = lt.tokenizer.encode_chat(t.messages)
        answer = lt.tokenizer.encode(t.answer, add_special_tokens=False) + [eot]
        if len(prompt) + 16 > max_len:
            continue
        out.append((prompt + answer[: max_len - len(prompt)], len(prompt)))
    return out


@partial(jax.jit, static_argnames=("graphdef", "taps"))
def _teacher_forced(graphdef, state, tokens, *, taps: tuple[int, ...]):
    """tokens [R,L] -> (taps f16 [R,L,n*H], the target's argmax after each position [R,L])."""
    model = nnx.merge(graphdef, state)
    r, seq_len = tokens.shape
    pages, num_pages = contiguous_pages(r, seq_len, PAGE_SIZE)
    cache = init_kv_cache(model.cfg, num_pages, PAGE_SIZE, model.dtype)
    pos = jnp.broadcast_to(jnp.arange(seq_len, dtype=jnp.int32), (r, seq_len))
    h, hidden, _ = model(tokens, pos, cache, pages, capture=taps, kv_len=seq_len)
    return hidden.astype(jnp.float16), jnp.argmax(model.logits(h), axis=-1).astype(jnp.int32)


def teacher_forced_shard(
    lt: LoadedTarget, rows: list[tuple[list[int], int]], taps: tuple[int, ...], seq_len: int
) -> tuple[dict[str, np.ndarray], dict[str, float]]:
    """A shard (the layout of `train.data`) of `rows` (token ids, answer start): taps from one forward per length
    bucket, loss mask on the answer tokens the target's argmax agrees with. Returns (arrays, stats)."""
    n = len(rows)
    graphdef, state = nnx.split(lt.model)
    tokens = np.zeros((n, seq_len), np.int32)
    lengths = np.array([len(ids) for ids, _ in rows], np.int32)
    for i, (ids, _) in enumerate(rows):
        tokens[i, : len(ids)] = ids
    tap_arr = np.zeros((n, seq_len, len(taps) * lt.cfg.hidden_size), np.float16)
    pred = np.zeros((n, seq_len), np.int32)
    order = np.argsort(lengths, kind="stable")
    i = 0
    while i < n:
        bucket = min(next((b for b in BUCKETS if b >= lengths[order[i]]), seq_len), seq_len)
        per = max(TOKENS_PER_CALL // bucket, 1)
        idx = [j for j in order[i : i + per] if lengths[j] <= bucket]
        batch = np.zeros((per, bucket), np.int32)
        batch[: len(idx)] = tokens[idx, :bucket]
        hid, arg = _teacher_forced(graphdef, state, jnp.asarray(batch), taps=taps)
        hid, arg = np.asarray(hid), np.asarray(arg)
        for k, j in enumerate(idx):
            tap_arr[j, : lengths[j]] = hid[k, : lengths[j]]
            pred[j, : lengths[j]] = arg[k, : lengths[j]]
        i += len(idx)
    loss_mask = np.zeros((n, seq_len), np.uint8)
    answer = 0
    for i, (ids, start) in enumerate(rows):
        span = np.arange(start, len(ids))
        agree = tokens[i, span] == pred[i, span - 1]
        loss_mask[i, span] = agree
        answer += len(span)
    stats = {"rows": n, "answer_tokens": answer, "kept": float(loss_mask.sum() / max(answer, 1))}
    return {"tokens": tokens, "loss_mask": loss_mask, "lengths": lengths, "taps": tap_arr}, stats


def earlier_answers(data_dir: Path, tokenizer, limit: int = 4096) -> list[str]:
    """The target's own answers (response tokens, end-of-turn removed) in the shards of a `train data` directory,
    at most `limit` of them, for the `earlier` task kind."""
    out: list[str] = []
    eos = tokenizer.eos_token_ids
    for f in sorted(data_dir.glob("shard_*.npz")):
        with np.load(f) as z:
            toks, mask = z["tokens"], z["loss_mask"]
        for t, m in zip(toks, mask, strict=True):
            ids = [int(x) for x in t[m > 0] if int(x) not in eos]
            text = tokenizer.decode(ids).strip()
            if 60 <= len(text) <= 900:
                out.append(text)
            if len(out) >= limit:
                return out
    return out


def build_known_dataset(
    lt: LoadedTarget,
    out_dir: Path,
    *,
    taps: tuple[int, ...],
    num_shards: int,
    rows_per_shard: int,
    seq_len: int,
    seed: int,
    earlier: list[str] | tuple[str, ...] = (),
    exclude: set[str] = frozenset(),
    progress=None,
    max_seconds: float | None = None,
) -> list[dict[str, float]]:
    """Write `shard_{i:05d}.npz` teacher-forced shards (resumable: existing shards are kept). Returns the stats
    of the shards written by this call."""
    out_dir.mkdir(parents=True, exist_ok=True)
    settings = {
        "taps": list(taps),
        "kind": "known-answers",
        "rows_per_shard": rows_per_shard,
        "seq_len": seq_len,
        "seed": seed,
        "earlier_answers": len(earlier),
    }
    meta = out_dir / "data.json"
    if meta.exists():
        old = json.loads(meta.read_text())["config"]
        if {k: old.get(k) for k in settings} != settings:
            raise UserError(f"{out_dir} holds data built with other settings ({old}); use another --out")
    meta.write_text(
        json.dumps({"config": settings, "target": lt.model_id, "hidden_size": lt.cfg.hidden_size}, indent=1)
    )
    t0 = time.monotonic()
    done = []
    for s in range(num_shards):
        f = out_dir / f"shard_{s:05d}.npz"
        if f.exists():
            continue
        if max_seconds is not None and time.monotonic() - t0 > max_seconds:
            break
        tasks = build_known_tasks(2 * rows_per_shard, seed=seed * 100_003 + s, earlier=earlier)
        rows = task_rows(lt, tasks, seq_len, exclude)[:rows_per_shard]
        t1 = time.monotonic()
        arrays, stats = teacher_forced_shard(lt, rows, taps, seq_len)
        stats["seconds"] = time.monotonic() - t1
        tmp = out_dir / f".shard_{s:05d}.tmp.npz"
        np.savez(tmp, **arrays)
        tmp.rename(f)
        done.append(stats)
        if progress:
            progress(s, num_shards, stats)
    return done
