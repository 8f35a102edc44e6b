"""Build the project's prompt collection for self-distillation: ``prompts.jsonl`` + held-out.

Run ``python -m selfspec.train.data.build_prompts`` to rewrite both files; the output is
deterministic (one seeded ``random.Random``). Prompts are written here from templates x topics
(chat, writing, code, math, extraction) plus summarising and extraction over passages of the text
that ships with Python itself (``pydoc_data.topics`` and stdlib module docstrings, read with
``ast`` and never imported). The held-out split uses its own topics and templates, so τ measured on
it is not measured on anything the heads saw during training.
"""

from __future__ import annotations

import ast
import json
import random
import sysconfig
from collections.abc import Callable, Iterator
from pathlib import Path

from selfspec.atomic import write_text_atomic

HERE = Path(__file__).parent
TRAIN_FILE = HERE / "prompts.jsonl"
HELDOUT_FILE = HERE / "prompts_heldout.jsonl"

CONCEPTS = [
    "photosynthesis",
    "inflation",
    "compound interest",
    "black holes",
    "machine learning",
    "the water cycle",
    "vaccines",
    "blockchain",
    "climate change",
    "plate tectonics",
    "supply and demand",
    "the immune system",
    "DNA replication",
    "electric cars",
    "recursion",
    "the stock market",
    "gravity",
    "the internet",
    "democracy",
    "evolution",
    "solar panels",
    "sleep cycles",
    "cloud computing",
    "the greenhouse effect",
    "antibiotics",
    "encryption",
    "the French Revolution",
    "quantum computing",
    "the human heart",
    "volcanoes",
    "tides",
    "neural networks",
    "the Roman Empire",
    "nuclear energy",
    "rainbows",
    "the placebo effect",
    "opportunity cost",
    "version control",
    "time zones",
    "the moon's phases",
    "earthquakes",
    "interest rates",
    "open source software",
    "the printing press",
    "batteries",
    "habits",
]
TASKS = [
    "learn a new language",
    "start running",
    "save money on groceries",
    "write a resume",
    "prepare for a job interview",
    "improve my sleep",
    "organise my week",
    "learn to cook",
    "start a vegetable garden",
    "reduce stress",
    "make friends in a new city",
    "learn to code",
    "give a good presentation",
    "read more books",
    "keep a houseplant alive",
    "plan a trip",
    "negotiate a salary",
    "study for an exam",
    "train a puppy",
    "start a small business",
    "write a cover letter",
    "stay focused while working from home",
    "learn to draw",
    "build a morning routine",
    "declutter my room",
    "prepare for a marathon",
    "learn chess",
]
THINGS = [
    "working from home",
    "electric cars",
    "social media",
    "living in a big city",
    "online classes",
    "renting versus buying a home",
    "nuclear power",
    "remote teams",
    "a four-day work week",
    "public transport",
    "homeschooling",
    "self-driving cars",
    "open offices",
    "freelancing",
    "e-books",
    "fast fashion",
    "video games",
    "space exploration",
    "smartphones for kids",
]
SUBJECTS = [
    "the sea",
    "autumn",
    "a lighthouse",
    "the city at night",
    "friendship",
    "a lost key",
    "the first snow",
    "a robot learning to paint",
    "an old library",
    "the mountains",
    "a cup of coffee",
    "a rainy Monday",
    "a dragon who is afraid of fire",
    "the stars",
    "a garden in spring",
    "a train journey",
    "a forgotten letter",
    "the ocean floor",
    "a cat on a windowsill",
    "a small bakery",
    "the desert",
    "a time traveller",
    "the moon",
]
PEOPLE = [
    "my manager",
    "a customer",
    "my landlord",
    "a colleague",
    "my professor",
    "a new client",
    "the team",
    "a supplier",
    "my neighbour",
    "the school principal",
    "a job recruiter",
]
REASONS = [
    "asking for a deadline extension",
    "thanking them for their help",
    "rescheduling a meeting",
    "reporting a problem with an order",
    "requesting a day off",
    "introducing a new project",
    "following up on an interview",
    "apologising for a delay",
    "asking for feedback",
    "announcing a change in schedule",
    "requesting a refund",
    "proposing a new idea",
]
PRODUCTS = [
    "a reusable water bottle",
    "noise-cancelling headphones",
    "a standing desk",
    "a smart watch",
    "a hiking backpack",
    "an electric kettle",
    "a mechanical keyboard",
    "a yoga mat",
    "a solar phone charger",
    "a coffee grinder",
    "a bamboo toothbrush",
    "a travel pillow",
]
CODE_TASKS = [
    "reverses a string",
    "checks whether a number is prime",
    "counts the vowels in a string",
    "returns the n-th Fibonacci number",
    "merges two sorted lists",
    "removes duplicates from a list",
    "finds the largest element in a list",
    "checks whether a string is a palindrome",
    "computes the factorial of a number",
    "flattens a nested list",
    "counts word frequencies",
    "converts Celsius to Fahrenheit",
    "sorts a list of dictionaries by a key",
    "reads a CSV file and prints each row",
    "validates an email address with a regex",
    "computes the average of a list of numbers",
    "finds the second largest number in a list",
    "checks whether two strings are anagrams",
    "returns the GCD of two numbers",
    "splits a list into chunks of size n",
    "capitalises the first letter of every word",
    "implements binary search",
    "transposes a matrix",
    "generates all subsets of a list",
    "reads a JSON file and returns a dictionary",
    "implements a simple stack class",
]
LANGUAGES = ["Python", "JavaScript", "Rust", "Go", "Java", "C", "Bash", "SQL"]
LANGUAGE_QUESTIONS = [
    "read a file line by line",
    "handle errors",
    "define a function",
    "loop over a list",
    "sort an array",
    "work with dictionaries or maps",
    "write a unit test",
    "format a string",
    "parse command-line arguments",
    "make an HTTP request",
    "create a class",
]
CODE_CONCEPTS = [
    "list comprehensions",
    "decorators",
    "generators",
    "closures",
    "recursion",
    "Big O notation",
    "hash tables",
    "linked lists",
    "REST APIs",
    "unit tests",
    "git branches",
    "async and await",
    "type hints",
    "garbage collection",
    "SQL joins",
    "regular expressions",
    "virtual environments",
]
NAMES = [
    "Alice Martin",
    "Bob Chen",
    "Carla Gomez",
    "David Okafor",
    "Emma Schulz",
    "Farid Haddad",
    "Grace Kim",
    "Hugo Rossi",
    "Ines Silva",
    "Jonas Berg",
    "Keiko Tanaka",
    "Liam O'Brien",
]
CITIES = ["Lisbon", "Toronto", "Nairobi", "Osaka", "Berlin", "Lima", "Dublin", "Seoul", "Oslo"]
MONTHS = ["January", "March", "April", "June", "July", "September", "October", "December"]

HELDOUT_CHAT = [
    "Hi! Can you tell me a fun fact about octopuses?",
    "What should I cook for dinner tonight if I only have eggs, rice and spinach?",
    "Can you explain how a rainbow forms?",
    "I feel nervous before exams. Any advice?",
    "What is the difference between weather and climate?",
    "How do airplanes stay in the air?",
    "Can you recommend a good way to start learning the guitar?",
    "Why is the sky blue?",
    "What are some healthy snacks I can take to work?",
    "How can I be more productive in the morning?",
    "What is a good name for a grey kitten?",
    "Explain what a computer's CPU does.",
    "How do I politely decline an invitation to a party?",
    "What are three tips for taking better photos with my phone?",
    "Tell me a short joke about programmers.",
    "How does a refrigerator keep food cold?",
    "What is the best way to memorise vocabulary?",
    "Can you describe what a typical day of a nurse looks like?",
    "Why do leaves change colour in autumn?",
    "What are the benefits of drinking water?",
    "How do bees make honey?",
    "Give me some ideas for a rainy weekend.",
    "What is the difference between a virus and a bacterium?",
    "How do I make a good first impression?",
    "What is the capital of Australia, and why is it not Sydney?",
    "Can you explain what a budget is and how to make one?",
    "Why do cats purr?",
    "How can I stop procrastinating?",
    "What should I pack for a weekend camping trip?",
    "How does a bicycle's gear system work?",
    "Write a short poem about a lighthouse keeper.",
    "Write a thank-you note to a teacher who helped me.",
    "Write a Python function that returns the sum of the squares of a list of numbers.",
    "Write a short story about a robot who finds a flower.",
    "Give me a recipe for a simple tomato soup.",
    "Explain the rules of tic-tac-toe.",
    "What are the planets in our solar system?",
    "How do I change a flat tyre on a bicycle?",
    "Summarise the plot of Romeo and Juliet in a few sentences.",
    "What is the difference between a list and a tuple in Python?",
    "A shop sells pens at 3 dollars each. How much do 7 pens cost?",
    "What is 15% of 80?",
    "List five animals that live in the ocean.",
    "How do I write a good email subject line?",
    "What is a healthy breakfast?",
    "Explain how the internet works to a ten-year-old.",
    "What are good habits for staying healthy while working at a desk?",
    "Describe the water cycle in simple words.",
    "What is the meaning of the word 'serendipity'?",
    "How can I improve my handwriting?",
    "Suggest a name and a slogan for a new coffee shop.",
    "What is the difference between 'affect' and 'effect'?",
    "How should I prepare for my first day at a new job?",
    "Can you explain what an API is?",
    "What are some fun things to do in Paris?",
    "Why is exercise good for mental health?",
    "Write a haiku about morning coffee.",
    "How do I calculate the area of a circle?",
    "What is machine translation and how does it work?",
    "Give me three tips for a good night's sleep.",
]


def chat_prompts(rng: random.Random) -> Iterator[str]:
    templates: list[tuple[str, list[str]]] = [
        ("Can you explain {} in simple terms?", CONCEPTS),
        ("What is {}? Give a short explanation.", CONCEPTS),
        ("Explain {} to a ten-year-old.", CONCEPTS),
        ("Why does {} matter in everyday life?", CONCEPTS),
        ("What are the most common misconceptions about {}?", CONCEPTS),
        ("How do I {}?", TASKS),
        ("I want to {}. Where should I start?", TASKS),
        ("Give me five practical tips to {}.", TASKS),
        ("What mistakes should I avoid when I try to {}?", TASKS),
        ("What are the pros and cons of {}?", THINGS),
        ("Is {} a good idea? Give me a balanced answer.", THINGS),
        ("How has {} changed the way people live?", THINGS),
        ("Tell me a short history of {}.", CONCEPTS),
        ("What would happen if {} suddenly stopped existing?", THINGS),
    ]
    for template, topics in templates:
        for topic in topics:
            yield template.format(topic)


def writing_prompts(rng: random.Random) -> Iterator[str]:
    for subject in SUBJECTS:
        yield f"Write a short poem about {subject}."
        yield f"Write a haiku about {subject}."
        yield f"Write the opening paragraph of a story about {subject}."
        yield f"Describe {subject} in three vivid sentences."
    for person in PEOPLE:
        for reason in rng.sample(REASONS, 5):
            yield f"Write a short, polite email to {person} {reason}."
    for product in PRODUCTS:
        yield f"Write a product description for {product}."
        yield f"Write a short advertisement slogan and tagline for {product}."
        yield f"Write a customer review of {product}."
    for thing in THINGS:
        yield f"Write a short persuasive paragraph in favour of {thing}."


def code_prompts(rng: random.Random) -> Iterator[str]:
    for task in CODE_TASKS:
        yield f"Write a Python function that {task}."
        yield f"Write a {rng.choice(LANGUAGES[1:4])} function that {task}."
        yield f"Write a Python function that {task}, with a docstring and a short example."
    for language in LANGUAGES:
        for question in rng.sample(LANGUAGE_QUESTIONS, 6):
            yield f"How do I {question} in {language}?"
    for concept in CODE_CONCEPTS:
        yield f"Explain {concept} with a short example."
        yield f"What are {concept} used for in programming?"
    for snippet in _code_snippets():
        yield f"Explain what this Python code does:\n\n```python\n{snippet}\n```"
        yield f"Find possible bugs or improvements in this code:\n\n```python\n{snippet}\n```"


def _code_snippets() -> list[str]:
    return [
        "def f(xs):\n    return [x * x for x in xs if x % 2 == 0]",
        "total = 0\nfor i in range(1, 11):\n    total += i\nprint(total)",
        "def g(s):\n    return s == s[::-1]",
        "import collections\ncounts = collections.Counter(words)\nprint(counts.most_common(3))",
        "def fib(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n"
        "    return a",
        "with open('data.txt') as fh:\n    lines = [line.strip() for line in fh]",
        "def merge(a, b):\n    return sorted(a + b)",
        "data = {'a': 1, 'b': 2}\nfor key, value in data.items():\n    print(key, value)",
        "def mean(xs):\n    return sum(xs) / len(xs)",
        "nums = [3, 1, 2]\nnums.sort(reverse=True)\nprint(nums[0])",
        "def count(text):\n    return len(text.split())",
        "squares = {n: n ** 2 for n in range(5)}",
    ]


def math_prompts(rng: random.Random) -> Iterator[str]:
    for _ in range(40):
        a, b = rng.randint(12, 99), rng.randint(12, 99)
        yield f"What is {a} times {b}? Show your working."
    for _ in range(30):
        a, x, b = rng.randint(2, 9), rng.randint(1, 12), rng.randint(1, 30)
        yield f"Solve for x: {a}x + {b} = {a * x + b}."
    for _ in range(30):
        percent, whole = rng.choice([5, 10, 15, 20, 25, 30, 40, 75]), rng.randint(2, 40) * 10
        yield f"What is {percent}% of {whole}?"
    for _ in range(40):
        name, price, count = rng.choice(NAMES).split()[0], rng.randint(2, 15), rng.randint(3, 12)
        item = rng.choice(["apples", "notebooks", "tickets", "pencils", "cupcakes", "books"])
        yield (
            f"{name} buys {count} {item} at {price} dollars each and pays with a "
            f"{(price * count // 50 + 1) * 50} dollar note. How much change does {name} get?"
        )
    for _ in range(25):
        speed, hours = rng.randint(30, 120), rng.randint(2, 9)
        yield f"A train travels at {speed} km/h for {hours} hours. How far does it go?"
    for _ in range(20):
        side = rng.randint(2, 20)
        shape = rng.choice(["square", "cube"])
        quantity = "area" if shape == "square" else "volume"
        yield f"What is the {quantity} of a {shape} with side length {side} cm?"
    for _ in range(15):
        numbers = rng.sample(range(1, 60), 5)
        yield f"What is the average of {', '.join(map(str, numbers))}?"


def passage_prompts(rng: random.Random, passages: list[str]) -> Iterator[str]:
    summarise = [
        "Summarise the following text in two sentences:\n\n{}",
        "Give a one-paragraph summary of this passage:\n\n{}",
        "Explain the main point of this text in plain English:\n\n{}",
        "TL;DR:\n\n{}",
    ]
    extract = [
        "List the Python keywords or built-in names mentioned in this text:\n\n{}",
        "Extract three key facts from the following text as a bullet list:\n\n{}",
        "Write two quiz questions, with answers, based on this text:\n\n{}",
    ]
    for index, passage in enumerate(passages):
        templates = summarise if index % 3 else extract
        yield rng.choice(templates).format(passage)


def record_prompts(rng: random.Random) -> Iterator[str]:
    for _ in range(70):
        name, city = rng.choice(NAMES), rng.choice(CITIES)
        day, month, year = rng.randint(1, 28), rng.choice(MONTHS), rng.randint(1990, 2024)
        age = rng.randint(19, 70)
        sentence = (
            f"{name}, aged {age}, moved to {city} on {day} {month} {year} to work as a "
            f"{rng.choice(['nurse', 'teacher', 'engineer', 'chef', 'designer', 'pilot'])}."
        )
        yield rng.choice(
            [
                "Extract the name, age, city and date from this sentence as JSON:\n\n{}",
                "From the sentence below, what is the person's job and where do they live?\n\n{}",
                "Turn this sentence into a table with columns field and value:\n\n{}",
            ]
        ).format(sentence)


def python_passages(rng: random.Random, count: int) -> list[str]:
    """Paragraphs of 200-700 characters from Python's own docs and stdlib docstrings."""
    import pydoc_data.topics

    texts = list(pydoc_data.topics.topics.values())
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for path in sorted(stdlib.glob("*.py")):
        try:
            doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8")))
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        if doc:
            texts.append(doc)
    paragraphs = {
        " ".join(p.split())
        for text in texts
        for p in text.split("\n\n")
        if 200 <= len(p) <= 700 and not p.lstrip().startswith((">>>", "*", "|", "+"))
    }
    return rng.sample(sorted(paragraphs), min(count, len(paragraphs)))


def build(seed: int = 0, passages: int = 330) -> tuple[list[str], list[str]]:
    """(train prompts, held-out prompts), deduplicated and shuffled with ``seed``."""
    rng = random.Random(seed)
    sources: list[Callable[[random.Random], Iterator[str]]] = [
        chat_prompts,
        writing_prompts,
        code_prompts,
        math_prompts,
        record_prompts,
    ]
    train = [p for source in sources for p in source(rng)]
    train.extend(passage_prompts(rng, python_passages(rng, passages)))
    heldout = list(dict.fromkeys(HELDOUT_CHAT))
    held = set(heldout)
    train = [p for p in dict.fromkeys(train) if p not in held]
    rng.shuffle(train)
    return train, heldout


def write_jsonl(path: Path, prompts: list[str]) -> None:
    """Atomic write: a temporary file beside ``path``, then a rename."""
    lines = (json.dumps({"prompt": prompt}, ensure_ascii=False) + "\n" for prompt in prompts)
    write_text_atomic(path, "".join(lines))


def write_collection(seed: int = 0, out_dir: Path = HERE) -> None:
    """Write prompts.jsonl and prompts_heldout.jsonl into ``out_dir``.

    Args:
        seed: seed of the sampling and the shuffle.
        out_dir: directory to write the two files to.
    """
    train, heldout = build(seed)
    out_dir.mkdir(parents=True, exist_ok=True)
    write_jsonl(out_dir / TRAIN_FILE.name, train)
    write_jsonl(out_dir / HELDOUT_FILE.name, heldout)
    print(f"wrote {len(train)} train and {len(heldout)} held-out prompts to {out_dir}")


if __name__ == "__main__":
    from jsonargparse import CLI

    CLI(write_collection)
