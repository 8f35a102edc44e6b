"""Heads and a draft corpus that ship with the package, made for the embedded default target."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from selfspec.heads.config import HeadKind

if TYPE_CHECKING:
    from selfspec.drafting.corpus import DraftCorpus

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


CORPUS = Path(__file__).parent / "assets" / "corpus" / "smollm2-135m-instruct.safetensors"
"""The default target's draft corpus: the data engine's 2.9 M response tokens
(`selfspec corpus`, from data/engine/smollm2-v1)."""


def resolve_corpus(spec: str, is_default_target: bool, model: object) -> DraftCorpus | None:
    """The draft corpus a ``--draft-corpus`` value names: 'auto' (the shipped corpus for the
    embedded default target, none for another), 'none', or a corpus file made for ``model``."""
    from selfspec.drafting.corpus import load_corpus
    from selfspec.fingerprint import fingerprint_of

    if spec == "none" or (spec == "auto" and not is_default_target):
        return None
    path = CORPUS if spec == "auto" else Path(spec).expanduser()
    if not path.is_file():
        raise FileNotFoundError(
            f"no draft corpus at {path}; build one with `selfspec corpus` or pass "
            "--draft-corpus none"
        )
    return load_corpus(path, fingerprint_of(model))
