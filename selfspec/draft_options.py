"""The drafting options `selfspec generate` and `selfspec serve` share: context drafts and the
draft corpus they retrieve from. One declaration, inherited like `TargetOptions`; no torch
import here (`selfspec --help` stays fast)."""

from __future__ import annotations

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
