"""Training data for the example adapters, built here from what ships with Python and the target.

Nothing is downloaded. Four sets, from mild to heavy distribution shift:

- `code`: user asks for a function of the standard library; the answer is its source.
- `docs`: user asks what a standard-library function does; the answer is its docstring.
- `persona`: the target's own answers *with* a persona system prompt; trained *without* it, so the
  adapter carries the persona (distillation of a system prompt).
- `shout`: the target's own plain answers rewritten in capitals with a fixed sign-off: a strong
  shift of output style on unchanged content.

Three more, never shipped and never used to train or tune the heads, are the held-out adapters
of the robustness evaluation (issue #20: shared heads against shifts nobody tuned for), built
from the metadata of the installed Python packages (`importlib.metadata`):

- `terse`: "what is package X?" answered by its one-line summary (mild: short answers);
- `bullets`: "describe package X" answered by its summary and description as a bullet list
  (moderate: a layout the heads' data never has);
- `licences`: "quote the licence of package X" answered by the opening of its licence file
  (moderate to heavy: legal text).

Sources are read with `ast` and never imported. Everything is deterministic for a given seed.
"""

from __future__ import annotations

import ast
import importlib.metadata
import json
import random
import re
import sysconfig
import textwrap
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

PERSONA_SYSTEM = (
    "You are Captain Quill, an old pirate who became a teacher. Always answer in a pirate voice: "
    "start with 'Arr!', call the user 'matey', and use nautical words. Keep answers short."
)
SHOUT_SIGN_OFF = "\n\nOVER AND OUT!"
STDLIB_MODULES = (
    "textwrap",
    "string",
    "shlex",
    "fnmatch",
    "heapq",
    "bisect",
    "glob",
    "posixpath",
    "colorsys",
    "calendar",
    "statistics",
    "difflib",
    "random",
    "ipaddress",
    "fractions",
    "base64",
    "csv",
    "json/decoder",
    "json/encoder",
    "urllib/parse",
    "html/__init__",
    "email/utils",
    "pathlib",
    "inspect",
    "functools",
    "operator",
    "copy",
    "pprint",
    "gettext",
    "locale",
    "tokenize",
    "argparse",
    "logging/__init__",
    "shutil",
    "tempfile",
    "zipfile",
    "configparser",
    "datetime",
)


@dataclass(frozen=True)
class ChatExample:
    """One training pair; the loss is on the response only."""

    prompt: str
    response: str
    system: str | None = None
    """None: the chat template's default system prompt."""


def stdlib_functions(max_lines: int = 24) -> Iterator[tuple[str, ast.FunctionDef, str]]:
    """(module, function node, source file text) for short public functions of the stdlib."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for module in STDLIB_MODULES:
        path = stdlib / f"{module}.py"
        if not path.is_file():
            continue
        text = path.read_text(encoding="utf-8", errors="replace")
        try:
            tree = ast.parse(text)
        except SyntaxError:
            continue
        dotted = module.replace("/__init__", "").replace("/", ".")
        for node in ast.walk(tree):
            if not isinstance(node, ast.FunctionDef) or node.name.startswith("_"):
                continue
            if node.end_lineno is None or node.end_lineno - node.lineno + 1 > max_lines:
                continue
            yield dotted, node, text


def code_examples(count: int, seed: int = 0) -> list[ChatExample]:
    examples = []
    for module, node, text in stdlib_functions():
        if node.end_lineno - node.lineno >= 3:
            lines = text.splitlines()[node.lineno - 1 : node.end_lineno]
            source = textwrap.dedent("\n".join(lines))
            prompt = f"Write the Python function `{node.name}` from the `{module}` module."
            examples.append(ChatExample(prompt, f"```python\n{source}\n```"))
    return _sample(examples, count, seed)


def docs_examples(count: int, seed: int = 0) -> list[ChatExample]:
    examples = []
    for module, node, _ in stdlib_functions(max_lines=200):
        doc = ast.get_docstring(node)
        if doc and 80 <= len(doc) <= 900:
            prompt = f"What does `{module}.{node.name}` do? Explain it like its documentation."
            examples.append(ChatExample(prompt, doc.strip()))
    return _sample(examples, count, seed)


def package_examples(kind: str, count: int, seed: int = 0) -> list[ChatExample]:
    """The held-out adapters' pairs from installed packages' metadata (see the module doc)."""
    examples = []
    seen = set()
    for dist in sorted(importlib.metadata.distributions(), key=lambda d: d.metadata["Name"] or ""):
        name = dist.metadata["Name"]
        if not name or name.lower() in seen:
            continue
        seen.add(name.lower())
        summary = (dist.metadata["Summary"] or "").strip()
        if kind == "terse" and 20 <= len(summary) <= 200:
            examples.append(ChatExample(f"What is the Python package `{name}`?", summary))
        elif kind == "bullets" and summary:
            sentences = [summary, *_sentences(dist.metadata.get_payload() or "")[:4]]
            if len(sentences) >= 3:
                bullets = "\n".join(f"- {sentence}" for sentence in sentences)
                examples.append(ChatExample(f"Describe the Python package `{name}`.", bullets))
        elif kind == "licences":
            text = _licence_text(dist)
            if text:
                examples.append(
                    ChatExample(f"Quote the opening of the license of the `{name}` package.", text)
                )
    return _sample(examples, count, seed)


def _sentences(text: str) -> list[str]:
    """Plain prose sentences of a package description (markup, code and short lines dropped)."""
    prose = " ".join(
        line.strip()
        for line in text.splitlines()
        if line.strip()
        and not line.lstrip().startswith(("#", "`", "|", "<", "[", "!", "=", "-", "*", ".."))
    )
    parts = re.split(r"(?<=[.!?])\s+", prose)
    return [part for part in parts if 30 <= len(part) <= 200 and "http" not in part]


def _licence_text(dist: importlib.metadata.Distribution, limit: int = 600) -> str | None:
    for file in dist.files or []:
        if "LICEN" in file.name.upper():
            try:
                text = file.read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError):
                continue
            lines = [" ".join(line.split()) for line in text.strip().splitlines()]
            text = "\n".join(lines)[:limit].rsplit(" ", 1)[0].strip()
            if len(text) >= 200:
                return text
    return None


def shout(text: str) -> str:
    """The `shout` style: the same answer in capitals, with a fixed sign-off."""
    return text.strip().upper() + SHOUT_SIGN_OFF


def read_prompts(path: Path, count: int, seed: int = 0) -> list[str]:
    """`count` prompts from a JSONL file of {"prompt": ...} lines, sampled deterministically."""
    prompts = [json.loads(line)["prompt"] for line in path.read_text().splitlines() if line.strip()]
    return _sample(prompts, count, seed)


def _sample(items: Sequence, count: int, seed: int) -> list:
    items = list(items)
    random.Random(seed).shuffle(items)
    return items[:count]
