"""Near-duplicate filtering of prompts: MinHash over word n-grams with LSH banding.

A 135M model asked for many user messages repeats itself; near-copies add tokens but no new
contexts for the heads. Each text becomes its set of word ``ngram``-grams (lower-cased), its
MinHash signature (``permutations`` universal hashes of 64-bit shingle hashes), cut into
``bands``; two texts sharing a band are candidates, kept as duplicates when their estimated
Jaccard similarity reaches ``threshold``. The first occurrence (in the given order) is kept.
Deterministic: shingles are hashed with blake2b, the permutations drawn from a fixed seed.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

_PRIME = (1 << 61) - 1
_WORD = re.compile(r"\w+", re.UNICODE)


@dataclass(frozen=True)
class DedupConfig:
    ngram: int = 3
    permutations: int = 64
    bands: int = 16
    threshold: float = 0.7
    """Estimated Jaccard similarity at or above which a later text is a duplicate."""

    def __post_init__(self) -> None:
        if self.ngram < 1 or self.permutations < 1 or self.bands < 1:
            raise ValueError("dedup needs ngram, permutations and bands >= 1")
        if self.permutations % self.bands:
            raise ValueError(
                f"dedup permutations ({self.permutations}) must be a multiple of bands "
                f"({self.bands})"
            )
        if not 0 < self.threshold <= 1:
            raise ValueError(f"dedup threshold must be in (0, 1], got {self.threshold}")


def shingles(text: str, ngram: int) -> set[str]:
    words = _WORD.findall(text.lower())
    if len(words) < ngram:
        return {" ".join(words)}
    return {" ".join(words[i : i + ngram]) for i in range(len(words) - ngram + 1)}


def signatures(texts: Sequence[str], config: DedupConfig) -> np.ndarray:
    """MinHash signature of each text. # [N, permutations] uint64"""
    rng = np.random.default_rng(0x5E1F5BEC)
    a = rng.integers(1, _PRIME, config.permutations, dtype=np.uint64)
    b = rng.integers(0, _PRIME, config.permutations, dtype=np.uint64)
    out = np.empty((len(texts), config.permutations), dtype=np.uint64)
    for row, text in enumerate(texts):
        hashes = np.array(
            [
                int.from_bytes(hashlib.blake2b(s.encode(), digest_size=8).digest(), "little")
                % _PRIME
                for s in shingles(text, config.ngram)
            ],
            dtype=np.uint64,
        )  # [n]
        # (a * h + b) mod p in exact integer arithmetic: Python ints, since a * h overflows 64 bits
        values = [
            (int(x) * hashes.astype(object) + int(y)) % _PRIME for x, y in zip(a, b, strict=True)
        ]
        out[row] = [int(v.min()) for v in values]
    return out


def near_duplicates(texts: Sequence[str], config: DedupConfig = DedupConfig()) -> list[int]:
    """Indices of the texts that nearly duplicate an earlier kept text, ascending."""
    if not texts:
        return []
    signature = signatures(texts, config)
    rows = config.permutations // config.bands
    buckets: dict[tuple[int, bytes], list[int]] = {}
    dropped: list[int] = []
    for index in range(len(texts)):
        bands = [
            (band, signature[index, band * rows : (band + 1) * rows].tobytes())
            for band in range(config.bands)
        ]
        candidates = {other for key in bands for other in buckets.get(key, ())}
        if any(
            float(np.mean(signature[index] == signature[other])) >= config.threshold
            for other in candidates
        ):
            dropped.append(index)
            continue
        for key in bands:
            buckets.setdefault(key, []).append(index)
    return dropped
