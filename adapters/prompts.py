"""Prompt sets for evaluation: JSONL, one `{"prompt": str}` or `{"messages": [...]}` a line."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

from selfspec.target import apply_chat_template

HELDOUT_FILE = "prompts_heldout.jsonl"


def default_prompts_file() -> Path:
    """The project's held-out prompts (`selfspec.train`'s data), located without importing it."""
    spec = importlib.util.find_spec("selfspec.train")
    locations = list(spec.submodule_search_locations or []) if spec else []
    for location in locations:
        path = Path(location) / "data" / HELDOUT_FILE
        if path.is_file():
            return path
    raise FileNotFoundError(
        f"the default held-out prompts ({HELDOUT_FILE} of selfspec.train) are not installed; "
        "pass --prompts FILE.jsonl"
    )


def read_prompt_file(path: Path, limit: int | None = None) -> list[str | list[dict[str, str]]]:
    """Prompts (plain strings or chat message lists) of a JSONL file, the first `limit` ones."""
    if not path.is_file():
        raise FileNotFoundError(f"prompts file {path} does not exist")
    prompts: list[str | list[dict[str, str]]] = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError as error:
            raise ValueError(f"{path}:{number} is not valid JSON: {error}") from error
        if isinstance(item, dict) and isinstance(item.get("prompt"), str) and item["prompt"]:
            prompts.append(item["prompt"])
        elif isinstance(item, dict) and isinstance(item.get("messages"), list) and item["messages"]:
            prompts.append(item["messages"])
        else:
            raise ValueError(
                f'{path}:{number}: expected {{"prompt": "..."}} or {{"messages": [...]}}'
            )
        if limit is not None and len(prompts) >= limit:
            break
    if not prompts:
        raise ValueError(f"prompts file {path} holds no prompts")
    return prompts


def encode_prompts(tokenizer, prompts: list) -> list[list[int]]:
    """Token ids of each prompt, through the chat template when the tokenizer has one."""
    return [apply_chat_template(tokenizer, prompt) for prompt in prompts]
