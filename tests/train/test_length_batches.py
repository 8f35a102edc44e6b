"""Length-grouped batches: every row once per epoch, similar lengths together, seeded order."""

from __future__ import annotations

import numpy as np
import pytest

from selfspec.train.length_batches import LengthGroupedBatches


def test_every_row_once_and_batches_far_more_uniform_than_random() -> None:
    lengths = np.random.default_rng(0).integers(10, 500, size=1003)
    sampler = LengthGroupedBatches(lengths, batch_size=4, seed=3, group=16)
    batches = list(sampler)
    assert len(batches) == len(sampler) == 251
    assert sorted(sum(batches, [])) == list(range(1003))
    padding = sum(len(b) * lengths[b].max() - lengths[b].sum() for b in batches)
    shuffled = np.random.default_rng(1).permutation(1003)
    random_padding = sum(
        4 * lengths[shuffled[i : i + 4]].max() - lengths[shuffled[i : i + 4]].sum()
        for i in range(0, 1003, 4)
    )
    assert padding < 0.2 * random_padding


def test_order_is_seeded_and_changes_with_the_epoch() -> None:
    lengths = list(range(100))
    first = list(LengthGroupedBatches(lengths, 4, seed=0))
    assert first == list(LengthGroupedBatches(lengths, 4, seed=0))
    sampler = LengthGroupedBatches(lengths, 4, seed=0)
    sampler.set_epoch(1)
    assert list(sampler) != first


def test_bad_sizes_are_refused() -> None:
    with pytest.raises(ValueError, match="batch_size >= 1"):
        LengthGroupedBatches([1, 2], batch_size=0)


def test_the_datamodule_batches_by_length_unless_told_not_to(distilled) -> None:
    from selfspec.train.datamodule import DistilledDataModule

    grouped = DistilledDataModule(distilled, batch_size=2, val_fraction=0)
    grouped.setup()
    loader = grouped.train_dataloader()
    assert isinstance(loader.batch_sampler, LengthGroupedBatches)
    assert sum(len(b["lengths"]) for b in loader) == len(grouped.train_set)
    plain = DistilledDataModule(distilled, batch_size=2, val_fraction=0, group_by_length=False)
    plain.setup()
    assert not isinstance(plain.train_dataloader().batch_sampler, LengthGroupedBatches)


def test_skip_continues_the_first_epoch_where_a_run_stopped() -> None:
    lengths = list(range(100))
    full = list(LengthGroupedBatches(lengths, 4, seed=0))
    continued = LengthGroupedBatches(lengths, 4, seed=0, skip=7)
    assert len(continued) == len(full) - 7
    assert list(continued) == full[7:]
    continued.set_epoch(1)  # later epochs are whole
    whole = LengthGroupedBatches(lengths, 4, seed=0)
    whole.set_epoch(1)
    assert len(continued) == len(full) and list(continued) == list(whole)
    with pytest.raises(ValueError, match="skip must be in"):
        LengthGroupedBatches(lengths, 4, skip=25)


def test_the_datamodule_skips_batches_only_in_a_seeded_order(distilled) -> None:
    from selfspec.train.datamodule import DistilledDataModule

    module = DistilledDataModule(distilled, batch_size=2, val_fraction=0, skip_batches=1)
    module.setup()
    assert len(module.train_dataloader().batch_sampler) == -(-len(module.train_set) // 2) - 1
    with pytest.raises(ValueError, match="needs group_by_length"):
        DistilledDataModule(distilled, skip_batches=1, group_by_length=False)


def test_lightning_sets_the_epoch_and_a_line_continues_past_its_first_epoch() -> None:
    """Lightning calls ``set_epoch`` only on a loader's sampler and its batch sampler's
    ``sampler``; each epoch then has its own order, and ``skip`` applies to the run's first."""
    from lightning.fabric.utilities.data import _set_sampler_epoch
    from torch.utils.data import DataLoader

    lengths = list(range(100))
    sampler = LengthGroupedBatches(lengths, 4, seed=0, skip=20)
    loader = DataLoader(list(range(100)), batch_sampler=sampler)
    _set_sampler_epoch(loader, 0)
    first = list(sampler)
    _set_sampler_epoch(loader, 1)
    second = list(sampler)
    assert len(first) == 5 and len(second) == len(sampler) == 25  # the skip is the first's only
    assert second == list(LengthGroupedBatches(lengths, 4, seed=0, first_epoch=1))
    assert second[-5:] != first
    # A later run continuing in epoch 1 where this one stops reads the rest of that order.
    later = LengthGroupedBatches(lengths, 4, seed=0, skip=7, first_epoch=1)
    loader = DataLoader(list(range(100)), batch_sampler=later)
    _set_sampler_epoch(loader, 0)
    assert list(later) == second[7:]
    _set_sampler_epoch(loader, 1)
    assert list(later) == list(LengthGroupedBatches(lengths, 4, seed=0, first_epoch=2))
    with pytest.raises(ValueError, match="first_epoch"):
        LengthGroupedBatches(lengths, 4, first_epoch=-1)
