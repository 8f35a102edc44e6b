"""``selfspec corpus``: a draft corpus from the target's own responses (the data engine's
output, or any `selfspec distill` dataset), for context drafts' retrieval chains
(``selfspec.drafting.corpus``). Only the responses go in (the tokens after each row's
``prompt_len``): what the target itself writes, not what it was asked."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from selfspec.drafting.corpus import DraftCorpus
from selfspec.fingerprint import fingerprint_of
from selfspec.target import TargetSpec, load_target
from selfspec.train.shards import load_distilled


@dataclass(frozen=True)
class CorpusConfig:
    """What ``selfspec corpus`` builds."""

    data: tuple[str, ...]
    """Distilled datasets (directories of shards), e.g. a data engine run's ``responses`` and
    ``followups``."""
    output: str
    """The corpus file to write (safetensors), atomically."""
    target: TargetSpec = field(default_factory=TargetSpec)
    """The model the responses came from: the corpus records its fingerprint and is refused
    for any other."""

    def __post_init__(self) -> None:
        if not self.data:
            raise ValueError("selfspec corpus needs at least one --data directory")
        object.__setattr__(self, "data", tuple(self.data))


def build_draft_corpus(config: CorpusConfig) -> tuple[Path, DraftCorpus]:
    """Read every response of ``config.data``, index them, write the corpus file."""
    target = load_target(config.target)
    vocab_size = int(target.model.get_output_embeddings().weight.shape[0])
    responses: list[list[int]] = []
    for path in config.data:
        rows = load_distilled(path)
        for ids, prompt_len in zip(rows["input_ids"], rows["prompt_len"], strict=True):
            responses.append(list(ids[prompt_len:]))
    corpus = DraftCorpus.from_sequences(responses, vocab_size)
    return corpus.save(Path(config.output), fingerprint_of(target.model)), corpus
