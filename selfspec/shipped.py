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


def resolve_heads_dir(spec: str, is_default_target: bool) -> Path:
    """The directory a ``--heads`` value names: 'eagle' / 'medusa' for the shipped heads (only
    for the embedded default target), anything else a heads directory."""
    if spec in (HeadKind.EAGLE.value, HeadKind.MEDUSA.value):
        if not is_default_target:
            raise ValueError(
                f"--heads {spec} names the heads shipped for the embedded default model; for "
                "another model pass --heads DIR (heads trained on it)"
            )
        return shipped_heads_dir(spec)
    return Path(spec).expanduser()
