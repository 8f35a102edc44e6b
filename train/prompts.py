"""Prompts for self-distillation: a JSONL file or a `datasets` dataset saved on disk.

A JSONL line is ``{"prompt": "..."}`` (one user turn) or ``{"messages": [{"role", "content"}...]}``
(a conversation to continue). A line that is not such an object is reported with its line number,
then skipped or fatal as the caller chooses; nothing is silently dropped.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from enum import Enum
from pathlib import Path

logger = logging.getLogger(__name__)

Prompt = str | list[dict[str, str]]


class OnBadLine(str, Enum):
    skip = "skip"
    """Report each bad line (with its number) and go on without it."""
    fail = "fail"
    """Stop at the first bad line with an error naming the file and line."""


class PromptsError(ValueError):
    """A prompt source that cannot be read; the message names the input and what is expected."""


@dataclass(frozen=True)
class PromptRecord:
    prompt: Prompt
    """A user message, or a list of chat messages."""
    source_index: int
    """Line number (1-based) in a JSONL file, or row index in a dataset."""


@dataclass(frozen=True)
class BadLine:
    line: int
    reason: str


def read_prompts(
    path: str | Path, on_bad_line: OnBadLine = OnBadLine.fail
) -> tuple[list[PromptRecord], list[BadLine]]:
    """Prompts from a JSONL file or a `datasets` directory, and the bad lines that were skipped."""
    path = Path(path)
    if path.is_dir():
        records, bad = _read_dataset(path), []
    elif path.is_file():
        records, bad = _read_jsonl(path, OnBadLine(on_bad_line))
    else:
        raise PromptsError(f"prompts {path} is neither a JSONL file nor a datasets directory")
    if not records:
        raise PromptsError(f"prompts {path} holds no usable prompt ({len(bad)} bad lines)")
    return records, bad


def _read_jsonl(path: Path, on_bad_line: OnBadLine) -> tuple[list[PromptRecord], list[BadLine]]:
    records: list[PromptRecord] = []
    bad: list[BadLine] = []
    with path.open(encoding="utf-8", errors="strict") as fh:
        for number, line in enumerate(fh, start=1):
            if not line.strip():
                continue
            try:
                prompt = _parse(json.loads(line))
            except (json.JSONDecodeError, PromptsError) as error:
                reason = error.msg if isinstance(error, json.JSONDecodeError) else str(error)
                if on_bad_line is OnBadLine.fail:
                    raise PromptsError(f"{path}:{number}: {reason}") from None
                logger.warning("%s:%d: skipped: %s", path, number, reason)
                bad.append(BadLine(number, reason))
                continue
            records.append(PromptRecord(prompt, number))
    return records, bad


def _read_dataset(path: Path) -> list[PromptRecord]:
    from datasets import load_from_disk

    try:
        data = load_from_disk(str(path))
    except (FileNotFoundError, ValueError) as error:
        raise PromptsError(f"prompts {path} is not a datasets directory: {error}") from error
    columns = set(data.column_names)
    column = "prompt" if "prompt" in columns else "messages" if "messages" in columns else None
    if column is None:
        raise PromptsError(
            f"prompts dataset {path} needs a 'prompt' or 'messages' column, has {sorted(columns)}"
        )
    records = []
    for index, value in enumerate(data[column]):
        try:
            records.append(PromptRecord(_parse({column: value}), index))
        except PromptsError as error:
            raise PromptsError(f"prompts dataset {path}, row {index}: {error}") from None
    return records


def _parse(obj: object) -> Prompt:
    if not isinstance(obj, dict):
        raise PromptsError('expected an object {"prompt": str} or {"messages": [...]}')
    if isinstance(obj.get("prompt"), str) and obj["prompt"].strip():
        return obj["prompt"]
    messages = obj.get("messages")
    if (
        isinstance(messages, list)
        and messages
        and all(
            isinstance(m, dict)
            and isinstance(m.get("role"), str)
            and isinstance(m.get("content"), str)
            for m in messages
        )
    ):
        return [{"role": m["role"], "content": m["content"]} for m in messages]
    raise PromptsError(
        'expected a non-empty "prompt" string or a "messages" list of {"role", "content"} objects'
    )
