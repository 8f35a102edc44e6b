"""Heads that ship with the package, trained for the embedded default target."""

from __future__ import annotations

from pathlib import Path

from selfspec.heads.config import HeadKind

ASSETS = Path(__file__).parent / "assets" / "heads"
SHIPPED_HEADS = {
    HeadKind.EAGLE: "smollm2-135m-instruct-eagle",
    HeadKind.MEDUSA: "smollm2-135m-instruct-medusa",
}


def shipped_heads_dir(kind: HeadKind | str = HeadKind.EAGLE) -> Path:
    """Directory of the shipped heads of ``kind`` for SmolLM2-135M-Instruct."""
    path = ASSETS / SHIPPED_HEADS[HeadKind(kind)]
    if not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"no shipped {HeadKind(kind).value} heads at {path}; train them with `selfspec train` "
            "(see the README) or pass --heads DIR"
        )
    return path
