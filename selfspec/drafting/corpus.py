"""Drafts retrieved from a corpus of the target's own writing: the continuation its past
responses most often gave after the n-gram the request now ends with.

Where the request's own context has nothing to copy (open questions, a first sentence), the
target still writes its habitual phrases, and a corpus of its own responses (the data engine's
output, `selfspec datagen`) says what usually follows the last few tokens: a retrieval draft
(REST). ``DraftCorpus`` holds the corpus as one token array and every position sorted by the
n-gram that starts there, packed into one integer key; a lookup is two binary searches, and the
chain follows the majority next token among the matched positions, depth by depth.

The chain is grafted into the tree beside the heads' nodes and the context chain, and scored
by the request's own observed rates like the context chain (``selfspec.drafting.context``), so
sizing keeps it only where it pays. Lossless like every draft.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from selfspec.atomic import write_file_atomic
from selfspec.fingerprint import BaseFingerprint, check_compatible

SEPARATOR = -1
"""Between two responses in the token array: no n-gram and no continuation crosses it."""
KEY_BITS = 63
"""Keys are int64: ``(vocab + 1) ** max_ngram`` must stay below 2 ** 63."""
MAX_MATCHES = 256
"""Most recent matched positions a lookup reads (the others rarely change the majority)."""


class CorpusError(ValueError):
    """A corpus file that cannot be used; the message names the file and what is wrong."""


def key_ngram(vocab_size: int, wanted: int = 4) -> int:
    """The longest n-gram (up to ``wanted``) whose packed key fits in an int64."""
    n = wanted
    while n > 1 and (vocab_size + 1) ** n >= 2**KEY_BITS:
        n -= 1
    return n


class DraftCorpus:
    """Token sequences, every position indexed by the n-gram that starts there."""

    def __init__(self, tokens: np.ndarray, vocab_size: int, max_ngram: int = 4) -> None:
        """tokens: # [N] int64, responses separated by ``SEPARATOR``."""
        if tokens.ndim != 1 or (tokens.size and (tokens.min() < SEPARATOR)):
            raise ValueError("corpus tokens must be a 1-D array of ids and -1 separators")
        if tokens.size >= 2**31 - 16:
            raise ValueError(f"a draft corpus holds fewer than 2**31 tokens, got {tokens.size}")
        if tokens.size and tokens.max() >= vocab_size:
            raise ValueError(f"corpus token {int(tokens.max())} is outside the vocabulary")
        self.vocab_size = vocab_size
        self.max_ngram = key_ngram(vocab_size, max_ngram)
        self.tokens = tokens.astype(np.int32)  # [N]; ids and positions fit in 32 bits
        base = vocab_size + 1
        shifted = np.concatenate([tokens.astype(np.int64) + 1, np.zeros(self.max_ngram, np.int64)])
        keys = np.zeros(self.tokens.size, np.int64)  # shifted ids: 0 = separator / end
        for offset in range(self.max_ngram):
            keys = keys * base + shifted[offset : offset + self.tokens.size]
        positions = np.nonzero(self.tokens != SEPARATOR)[0].astype(np.int32)
        position_keys = keys[positions]  # [P] int64
        order = np.argsort(position_keys, kind="stable")  # ties: earlier positions first
        self._keys = position_keys[order]  # [P] int64, sorted
        self._positions = positions[order]  # [P] int32
        self._base = base

    @classmethod
    def from_sequences(cls, sequences: Sequence[Sequence[int]], vocab_size: int) -> DraftCorpus:
        parts: list[int] = []
        for sequence in sequences:
            parts.extend(int(t) for t in sequence)
            parts.append(SEPARATOR)
        return cls(np.asarray(parts, dtype=np.int64), vocab_size)

    @property
    def size(self) -> int:
        """Tokens held, separators excluded."""
        return int(self._positions.size)

    def continuation(
        self, context: Sequence[int], max_tokens: int, min_ngram: int = 2
    ) -> tuple[list[int], int]:
        """(the majority continuation of the longest n-gram ending ``context`` that the corpus
        holds, up to ``max_tokens``; that n), or ([], 0)."""
        tokens = self.tokens
        for n in range(min(self.max_ngram, len(context)), min_ngram - 1, -1):
            packed = 0
            for token in context[-n:]:
                packed = packed * self._base + int(token) + 1
            low = packed * self._base ** (self.max_ngram - n)
            high = (packed + 1) * self._base ** (self.max_ngram - n)
            first, last = np.searchsorted(self._keys, [low, high], side="left")
            if last <= first:
                continue
            follow = self._positions[max(first, last - MAX_MATCHES) : last] + n  # [M]
            chain: list[int] = []
            while len(chain) < max_tokens and follow.size:
                if follow.size == 1:  # one match left: its own continuation, to its end
                    start = int(follow[0])
                    rest = tokens[start : start + max_tokens - len(chain)].tolist()
                    chain += rest[: rest.index(SEPARATOR)] if SEPARATOR in rest else rest
                    break
                nexts = tokens[np.minimum(follow, tokens.size - 1)]
                nexts = np.where(follow < tokens.size, nexts, SEPARATOR)  # [M]
                ids, counts = np.unique(nexts[nexts != SEPARATOR], return_counts=True)
                if not ids.size:
                    break
                best = int(ids[counts.argmax()])
                chain.append(best)
                follow = follow[nexts == best] + 1
            if chain:
                return chain, n
        return [], 0

    def save(self, path: Path, fingerprint: BaseFingerprint) -> Path:
        """One safetensors file (uint16 / int32 ids, separators as the vocabulary size), the
        base model's fingerprint in its metadata; written atomically."""
        stored = np.where(self.tokens == SEPARATOR, self.vocab_size, self.tokens)
        tensor = torch.from_numpy(stored.astype(np.int32))
        tensor = tensor.to(torch.uint16) if self.vocab_size < 2**16 else tensor
        metadata = {
            "format": "selfspec-draft-corpus",
            "vocab_size": str(self.vocab_size),
            "fingerprint": json.dumps(fingerprint.to_dict()),
        }
        return write_file_atomic(
            Path(path), lambda temporary: save_file({"tokens": tensor}, temporary, metadata)
        )


def load_corpus(path: Path, fingerprint: BaseFingerprint) -> DraftCorpus:
    """The corpus saved at ``path``; refuses one made for another base model."""
    path = Path(path)
    try:
        with safe_open(str(path), framework="pt") as handle:  # one read: metadata and tokens
            metadata = handle.metadata() or {}
            tokens = handle.get_tensor("tokens")
    except (OSError, SafetensorError, KeyError) as error:
        raise CorpusError(f"draft corpus {path} cannot be read: {error}") from error
    if metadata.get("format") != "selfspec-draft-corpus":
        raise CorpusError(f"{path} is not a selfspec draft corpus (no format in its metadata)")
    try:
        vocab_size = int(metadata["vocab_size"])
        made_for = BaseFingerprint.from_dict(json.loads(metadata["fingerprint"]))
    except (KeyError, ValueError, TypeError) as error:
        raise CorpusError(f"draft corpus {path} has malformed metadata: {error}") from error
    check_compatible(made_for, fingerprint, f"draft corpus {path}")
    ids = tokens.to(torch.int64).numpy()
    if ids.ndim != 1 or (ids.size and (ids.min() < 0 or ids.max() > vocab_size)):
        raise CorpusError(f"draft corpus {path} holds ids outside 0..{vocab_size}")
    return DraftCorpus(np.where(ids == vocab_size, SEPARATOR, ids), vocab_size)
