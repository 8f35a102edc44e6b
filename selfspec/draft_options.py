"""The drafting options `selfspec generate` and `selfspec serve` share: context drafts and the
draft corpus they retrieve from. One declaration, inherited like `TargetOptions`; no torch
import here (`selfspec --help` stays fast)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from selfspec.drafting.context import ContextDrafts
    from selfspec.drafting.corpus import DraftCorpus


@dataclass(frozen=True, kw_only=True)
class DraftOptions:
    context_drafts: bool = field(
        default=True,
        metadata={
            "help": "also draft chains copied from the prompt and the text so far, and retrieved "
            "from --draft-corpus, into each tree (lossless); --no-context-drafts: the heads' "
            "drafts alone"
        },
    )
    draft_corpus: str = field(
        default="auto",
        metadata={
            "help": "the corpus of the target's own responses context drafts retrieve from "
            "(`selfspec corpus`): auto (the shipped one for the default model) | none | FILE"
        },
    )

    def context_drafts_config(self) -> ContextDrafts | None:
        """What ``GenerationConfig.context_drafts`` takes."""
        from selfspec.drafting.context import ContextDrafts

        return ContextDrafts() if self.context_drafts else None

    def corpus_for(self, model: object, is_default_target: bool) -> DraftCorpus | None:
        """The draft corpus to give a speculating generator (None without context drafts)."""
        from selfspec.shipped import resolve_corpus

        if not self.context_drafts:
            return None
        return resolve_corpus(self.draft_corpus, is_default_target, model)


CONTEXT_MODES: dict[str, tuple[bool, ...]] = {"off": (False,), "on": (True,), "both": (False, True)}
"""A benchmark's ``--context-drafts``: its speculative rows draft with the heads alone (off), with
chains copied from the request's context as well (on: rows "... + context", the CLI's and the
server's default), or are measured both ways."""


def add_context_draft_arguments(parser: argparse.ArgumentParser, default: str = "both") -> None:
    """A benchmark's ``--context-drafts {off,on,both}`` and ``--draft-corpus``."""
    parser.add_argument(
        "--context-drafts",
        choices=list(CONTEXT_MODES),
        default=default,
        help="speculative rows with the heads' drafts alone (off), with chains copied from the "
        "request's context too (on: the CLI's default), or both",
    )
    parser.add_argument(
        "--draft-corpus",
        default="auto",
        help="context drafts also retrieve from this corpus: auto (the shipped one) | none | FILE",
    )
