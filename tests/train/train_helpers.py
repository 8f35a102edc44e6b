"""Prompt data shared by the training tests (importable by name, unlike conftest)."""

from __future__ import annotations

import json
from pathlib import Path

PROMPTS = [f"tell me about {word}" for word in ("cats", "rain", "tea", "maps", "code", "sun")] * 4


def write_prompts(path: Path, prompts: list[str]) -> Path:
    path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    return path
