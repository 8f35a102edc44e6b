"""Drafts copied from the request's own context (and retrieved from a corpus of the target's
own writing): chains grafted into the heads' tree.

Where the text being written repeats what the request already holds (a summary or an answer
quoting its passage, names and numbers carried into a translation, code echoed back, a small
model's own loops), the continuation after the latest earlier occurrence of the last few tokens
is a cheap, often long draft that heads trained on other text cannot make (prompt lookup
decoding). ``ContextIndex`` keeps every n-gram of the prompt and the committed tokens with its
most recent end; each step the longest n-gram ending at the root proposes the tokens that
followed it, a chain that ``grow.graft_context`` adds to the heads' tree (sharing nodes the heads
drafted too), scored so that tree sizing weighs it against the heads' nodes. With a draft corpus
(``selfspec.drafting.corpus``) a second chain comes from there, scored by its own rates.

Lossless like every draft: the target verifies the chain in the same forward, and a chain is
chosen without the target's randomness, so the point-mass rule verifies it exactly.

A chain token's score is its estimated log-probability of acceptance: log(first[n]) + (i - 1) *
log(next) for the i-th token, where first[n] is the request's running rate at which a chain
found by an n-gram match begins with the token the target then commits, and next the rate at
which a chain token matches given that the one before it did (a copy, once on, tends to go on:
next is usually well above first). Both are observed every step, whether the chain was kept in
the tree or not, so a rate that fell can recover.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import Enum

from selfspec.drafting.corpus import DraftCorpus

PRIOR_MATCHED = 1.0
PRIOR_TRIED = 2.0
"""Pseudo-counts of each match rate before any observation: 0.5."""


@dataclass
class MatchRate:
    """A running rate with pseudo-counts."""

    matched: float = PRIOR_MATCHED
    tried: float = PRIOR_TRIED

    @property
    def value(self) -> float:
        return min(max(self.matched / self.tried, 1e-3), 1.0 - 1e-3)

    def add(self, matched: int, tried: int) -> None:
        self.matched += matched
        self.tried += tried


@dataclass(frozen=True)
class ContextDrafts:
    """How a request drafts from its own context and the generator's draft corpus
    (``GenerationConfig.context_drafts``)."""

    max_tokens: int = 8
    """Longest chain proposed per step."""
    max_ngram: int = 4
    """Longest suffix looked up; a longer match is tried first and wins."""
    min_ngram: int = 1
    """Shortest suffix looked up (1: the root token alone can propose a chain)."""
    corpus: bool = True
    """Also retrieve a chain from the generator's draft corpus, where it has one."""
    corpus_min_ngram: int = 2
    """Shortest suffix looked up in the corpus (a single token matches too much there)."""

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"context drafts max_tokens must be >= 1, got {self.max_tokens}")
        if not 1 <= self.min_ngram <= self.max_ngram:
            raise ValueError(
                "context drafts need 1 <= min_ngram <= max_ngram, got "
                f"min_ngram={self.min_ngram}, max_ngram={self.max_ngram}"
            )
        if not 1 <= self.corpus_min_ngram <= self.max_ngram:
            raise ValueError(
                "context drafts need 1 <= corpus_min_ngram <= max_ngram, got "
                f"corpus_min_ngram={self.corpus_min_ngram}, max_ngram={self.max_ngram}"
            )


class ChainSource(str, Enum):
    """Where a chain was found."""

    CONTEXT = "context"
    """The request's own prompt and output so far."""
    CORPUS = "corpus"
    """The generator's draft corpus: the target's past responses."""


@dataclass(frozen=True)
class ContextChain:
    """One step's proposal: tokens to follow the root, each with its score."""

    tokens: tuple[int, ...]
    scores: tuple[float, ...]
    """Estimated log-probability that the chain is accepted up to and including each token;
    non-increasing, as the scores of a drafted path are."""
    ngram: int = 1
    """The length of the suffix whose earlier occurrence proposed the chain."""
    source: ChainSource = ChainSource.CONTEXT


@dataclass
class SourceRates:
    """One source's observed match rates (see the module docstring)."""

    max_ngram: int
    first: list[MatchRate] = field(init=False)
    """Index n (1..max_ngram): P(a chain found by an n-gram match starts right)."""
    next: MatchRate = field(default_factory=MatchRate)
    """P(a chain token matches | the one before it did)."""

    def __post_init__(self) -> None:
        self.first = [MatchRate() for _ in range(self.max_ngram + 1)]

    def scores(self, ngram: int, length: int) -> tuple[float, ...]:
        first, step = math.log(self.first[ngram].value), math.log(self.next.value)
        return tuple(first + step * i for i in range(length))


class ContextIndex:
    """One request's tokens (prompt, then everything committed; the last is the step's root)
    with the latest end of every n-gram that has a following token, the draft corpus it also
    reads (if any), and each source's match rates."""

    def __init__(
        self, options: ContextDrafts, tokens: Sequence[int], corpus: DraftCorpus | None = None
    ) -> None:
        self.options = options
        self.corpus = corpus if options.corpus else None
        self._tokens: list[int] = []
        self._latest_end: dict[tuple[int, ...], int] = {}
        self.rates = {source: SourceRates(options.max_ngram) for source in ChainSource}
        self.extend(tokens)

    def extend(self, tokens: Sequence[int]) -> None:
        """Append committed tokens."""
        low, high = self.options.min_ngram, self.options.max_ngram
        for token in tokens:
            self._tokens.append(int(token))
            end = len(self._tokens) - 2  # the n-grams ending here now have a follower
            for n in range(low, min(high, end + 1) + 1):
                self._latest_end[tuple(self._tokens[end - n + 1 : end + 1])] = end

    def propose(self) -> tuple[ContextChain, ...]:
        """This step's chains: the context's (the continuation of the longest n-gram ending at
        the last token that occurred before, from its latest occurrence), then the corpus's;
        each where there is one."""
        chains = []
        context = self._from_context()
        if context is not None:
            chains.append(context)
        if self.corpus is not None:
            options = self.options
            tokens, n = self.corpus.continuation(
                self._tokens[-options.max_ngram :], options.max_tokens, options.corpus_min_ngram
            )
            if tokens:
                scores = self.rates[ChainSource.CORPUS].scores(n, len(tokens))
                chains.append(ContextChain(tuple(tokens), scores, n, ChainSource.CORPUS))
        return tuple(chains)

    def _from_context(self) -> ContextChain | None:
        tokens, options = self._tokens, self.options
        for n in range(min(options.max_ngram, len(tokens)), options.min_ngram - 1, -1):
            end = self._latest_end.get(tuple(tokens[-n:]))
            if end is not None:
                chain = tuple(tokens[end + 1 : end + 1 + options.max_tokens])
                return ContextChain(chain, self.rates[ChainSource.CONTEXT].scores(n, len(chain)), n)
        return None

    def observe(self, chains: Sequence[ContextChain], committed: Sequence[int]) -> None:
        """Fold in how far each of ``chains`` agreed with the tokens the step then committed."""
        for chain in chains:
            self._observe(chain, committed)

    def _observe(self, chain: ContextChain, committed: Sequence[int]) -> None:
        matched = 0
        for proposed, actual in zip(chain.tokens, committed, strict=False):
            if proposed != actual:
                break
            matched += 1
        testable = min(len(chain.tokens), len(committed))
        missed = 1 if matched < testable else 0
        rates = self.rates[chain.source]
        rates.first[chain.ngram].add(min(matched, 1), 1 if testable else 0)
        if matched:  # tokens 2.. were tried only where token 1 matched
            rates.next.add(matched - 1, matched - 1 + missed)
