"""Batches of rows of similar length: less padding, the same rows, a seeded order.

Rows are right-padded to the longest in their batch; drawn at random, a batch of 4 rows of the
data engine's lengths (10 % / 50 % / 90 %: 114 / 342 / 476 tokens) is about a third padding,
and every padded position costs a full unrolled head step. Here each epoch shuffles the rows
(seed + epoch), cuts the order into groups of ``group`` batches, sorts each group by length and
cuts it into batches, then shuffles the batches: rows stay random at the scale of a group, each
batch is nearly uniform in length. Every row appears exactly once per epoch.

``skip`` continues an epoch in a later run: the heads of a run cut short (a session's time) are
exported and a new run starts from them (``init_from``) on the batches of the same epoch that
the first run did not reach, in the same order; ``first_epoch`` says which epoch of the order
that is, for a line of runs past its first epoch.

Lightning sets the epoch at the start of each one (``set_epoch``), but only on a data loader's
``sampler`` and on its batch sampler's ``sampler``: this batch sampler is its own ``sampler``
for that (without it every epoch replayed the first one's order, and with ``skip`` only its
tail: a 2026-12-06 run read the last 146 batches of an epoch three times).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np
from torch.utils.data import Sampler


class LengthGroupedBatches(Sampler[list[int]]):
    def __init__(
        self,
        lengths: Sequence[int],
        batch_size: int,
        seed: int = 0,
        group: int = 64,
        skip: int = 0,
        first_epoch: int = 0,
    ) -> None:
        """``skip``: batches of this run's first epoch (``first_epoch``) to leave out, from its
        start."""
        if batch_size < 1 or group < 1:
            raise ValueError(f"need batch_size >= 1 and group >= 1, got {batch_size}, {group}")
        self.lengths = np.asarray(lengths, dtype=np.int64)  # [rows]
        self.batch_size, self.seed, self.group = batch_size, seed, group
        full = -(-len(self.lengths) // batch_size)
        if not 0 <= skip < full:
            raise ValueError(f"skip must be in [0, {full}) (batches in an epoch), got {skip}")
        if first_epoch < 0:
            raise ValueError(f"first_epoch must be >= 0, got {first_epoch}")
        self.skip, self.first_epoch = skip, first_epoch
        self.epoch = first_epoch
        self.sampler = self  # where Lightning looks for ``set_epoch`` (see the module docstring)

    def set_epoch(self, epoch: int) -> None:
        """Called by Lightning at the start of each epoch (``epoch`` counts this run's epochs
        from 0): a new order per epoch."""
        self.epoch = self.first_epoch + epoch

    @property
    def epoch_batches(self) -> int:
        """Batches of a whole epoch."""
        return -(-len(self.lengths) // self.batch_size)

    @property
    def _skipped(self) -> int:
        return self.skip if self.epoch == self.first_epoch else 0

    def __len__(self) -> int:
        return self.epoch_batches - self._skipped

    def __iter__(self) -> Iterator[list[int]]:
        rng = np.random.default_rng((self.seed, self.epoch))
        order = rng.permutation(len(self.lengths))
        span = self.batch_size * self.group
        batches = []
        for start in range(0, len(order), span):
            chunk = order[start : start + span]
            chunk = chunk[np.argsort(-self.lengths[chunk], kind="stable")]  # longest first
            batches += [
                chunk[i : i + self.batch_size] for i in range(0, len(chunk), self.batch_size)
            ]
        shuffled = rng.permutation(len(batches))
        for index in shuffled[self._skipped :]:
            yield batches[index].tolist()
