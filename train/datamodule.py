"""The LightningDataModule over a distilled dataset (see `selfspec.train.shards`).

Rows are right-padded into batches: ``input_ids`` # [B, L], ``lengths`` and ``prompt_len`` # [B],
and, when the dataset stored them, ``features`` # [B, L-1, H] (the last token's feature is never
needed: nothing after it is trained) and, for EAGLE-3 heads, ``layer_features`` # [B, L-1, k*H]
(the target's states at k layers, concatenated) with ``layer_ids`` # [B, k] naming those layers.
Validation is a separate distilled dataset (e.g. of the held-out prompts) or, without one, a
seeded ``val_fraction`` of the training rows.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
import pyarrow.compute as pc
import torch
from torch.utils.data import DataLoader

from selfspec.train.datagen.features import load_stage, row_states
from selfspec.train.draft_vocab import response_token_counts
from selfspec.train.length_batches import LengthGroupedBatches
from selfspec.train.shards import DistilledDataError, load_distilled


class DistilledDataModule(L.LightningDataModule):
    def __init__(
        self,
        train_data: str | list[str],
        val_data: str | None = None,
        val_fraction: float = 0.05,
        batch_size: int = 8,
        max_length: int = 512,
        max_rows: int | None = None,
        num_workers: int = 0,
        seed: int = 0,
        group_by_length: bool = True,
        skip_batches: int = 0,
        first_epoch: int = 0,
    ) -> None:
        """
        Args:
            train_data: directory written by ``selfspec distill``, or a list of them (e.g.
                greedy and sampled responses to the same prompts), concatenated.
            val_data: a second distilled directory for validation (held-out prompts).
            val_fraction: share of train rows held out when val_data is not given. The split is
                by row: when several directories answer the same prompts, a prompt can land on
                both sides and the held-out score reads high; give val_data (held-out prompts).
            batch_size: rows per batch (per process under DDP).
            max_length: rows are cut to this many tokens.
            max_rows: use only the first rows of train_data, the directories concatenated in
                order (quick runs).
            num_workers: DataLoader worker processes.
            seed: seed of the validation split and of the length-grouped batch order.
            group_by_length: batch rows of similar length (``LengthGroupedBatches``: a third
                less padding on the data engine's rows); off, or under DDP (where Lightning
                distributes a plain shuffle), batches are drawn uniformly.
            skip_batches: with ``group_by_length``, leave out the first batches of the first
                epoch: a run continuing (``--model.init_from``) the exported heads of a run cut
                short trains on what that run did not reach (its ``batches_seen`` in
                metrics.json, with the same seed and batch size).
            first_epoch: with ``group_by_length``, the epoch of the seeded order this run
                starts in (``skip_batches`` counts in it): a line of runs past its first epoch
                continues with the exported ``data_epoch`` and ``batches_done``.
        """
        super().__init__()
        if batch_size < 1 or max_length < 3 or not 0 <= val_fraction < 1:
            raise ValueError(
                f"need batch_size >= 1, max_length >= 3, 0 <= val_fraction < 1; got {batch_size}, "
                f"{max_length}, {val_fraction}"
            )
        self.train_data, self.val_data = train_data, val_data
        self.val_fraction, self.batch_size, self.max_length = val_fraction, batch_size, max_length
        self.max_rows, self.num_workers, self.seed = max_rows, num_workers, seed
        self.group_by_length = group_by_length
        if skip_batches < 0:
            raise ValueError(f"skip_batches must be >= 0, got {skip_batches}")
        if skip_batches and not group_by_length:
            raise ValueError("skip_batches needs group_by_length (a seeded batch order)")
        self.skip_batches = skip_batches
        if first_epoch < 0:
            raise ValueError(f"first_epoch must be >= 0, got {first_epoch}")
        self.first_epoch = first_epoch
        self.train_set: Any = None
        self.val_set: Any = None

    def setup(self, stage: str | None = None) -> None:
        if self.train_set is not None:
            return
        from datasets import concatenate_datasets

        paths = (
            [self.train_data] if isinstance(self.train_data, (str, Path)) else list(self.train_data)
        )
        if not paths:
            raise DistilledDataError("train_data names no distilled directory")
        parts = [_load(path) for path in paths]
        # Directories may carry different extra columns (a data-engine run with adapters
        # records each row's answerer): train on the columns they all have.
        common = set.intersection(*(set(part.column_names) for part in parts))
        parts = [p.select_columns([c for c in p.column_names if c in common]) for p in parts]
        data = parts[0] if len(parts) == 1 else concatenate_datasets(parts)
        if self.max_rows is not None:
            data = data.select(range(min(self.max_rows, len(data))))
        _check_rows(data, self.train_data)
        if self.val_data is not None:
            self.train_set, self.val_set = data, load_distilled(self.val_data)
            _check_rows(self.val_set, self.val_data)
        elif self.val_fraction > 0 and len(data) >= 2:
            split = data.train_test_split(test_size=self.val_fraction, seed=self.seed)
            self.train_set, self.val_set = split["train"], split["test"]
        else:
            self.train_set = data
        self.train_set = self.train_set.with_format("numpy")
        if self.val_set is not None:
            self.val_set = self.val_set.with_format("numpy")

    def train_dataloader(self) -> DataLoader:
        trainer = getattr(self, "trainer", None)
        if self.group_by_length and (trainer is None or trainer.world_size == 1):
            ids = self.train_set.with_format("arrow")["input_ids"]  # the split's rows, in order
            lengths = np.minimum(pc.list_value_length(ids).to_numpy(), self.max_length)
            return DataLoader(
                self.train_set,
                batch_sampler=LengthGroupedBatches(
                    lengths,
                    self.batch_size,
                    self.seed,
                    skip=self.skip_batches,
                    first_epoch=self.first_epoch,
                ),
                collate_fn=self.collate,
                num_workers=self.num_workers,
            )
        return DataLoader(
            self.train_set,
            batch_size=self.batch_size,
            shuffle=True,
            collate_fn=self.collate,
            num_workers=self.num_workers,
            drop_last=False,
        )

    def val_dataloader(self) -> DataLoader | list:
        if self.val_set is None:
            return []
        return DataLoader(
            self.val_set,
            batch_size=self.batch_size,
            shuffle=False,
            collate_fn=self.collate,
            num_workers=self.num_workers,
        )

    def response_token_counts(self, vocab_size: int) -> torch.Tensor:
        """How often each token id occurs in the responses of the training rows. # [vocab]"""
        return response_token_counts(self.train_set, vocab_size)

    def collate(self, rows: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        if "features_file" in rows[0]:  # a data-engine stage: the states are in the cache
            rows = [row_states(row) for row in rows]
        lengths = [min(len(r["input_ids"]), self.max_length) for r in rows]
        width = max(lengths)
        input_ids = torch.zeros(len(rows), width, dtype=torch.long)  # [B, L]
        for i, (row, n) in enumerate(zip(rows, lengths, strict=True)):
            input_ids[i, :n] = torch.as_tensor(np.asarray(row["input_ids"][:n], dtype=np.int64))
        batch = {
            "input_ids": input_ids,
            "lengths": torch.tensor(lengths),
            "prompt_len": torch.tensor([int(r["prompt_len"]) for r in rows]),
        }
        for name in ("features", "layer_features"):
            if name in rows[0]:
                batch[name] = _padded_states(rows, name, lengths, width - 1)
        if "layer_features" in rows[0]:
            if "layer_ids" not in rows[0]:
                raise DistilledDataError(
                    "a dataset with layer_features needs a layer_ids column naming their layers"
                )
            batch["layer_ids"] = torch.tensor(np.asarray([r["layer_ids"] for r in rows]))  # [B, k]
        return batch


def _load(path: str):
    """A distilled directory, or a data-engine stage (with its cached features)."""
    if (Path(path).parent / "engine.json").is_file():
        return load_stage(path)
    return load_distilled(path)


def _padded_states(rows: list[dict[str, Any]], name: str, lengths: list[int], width: int):
    """Per-position float16 states of each row (its first length - 1), zero-padded.
    # [B, width, D] float32"""
    depth = np.asarray(rows[0][name]).shape[-1]
    states = torch.zeros(len(rows), width, depth)
    for i, (row, n) in enumerate(zip(rows, lengths, strict=True)):
        states[i, : n - 1] = torch.from_numpy(np.asarray(row[name][: n - 1], dtype=np.float32))
    return states


def _check_rows(data: Any, name: str) -> None:
    """Reject rows the losses cannot use, naming the dataset and the first bad row."""
    lengths = np.array([len(ids) for ids in data["input_ids"]])
    prompt_len = np.asarray(data["prompt_len"])
    bad = np.nonzero((prompt_len < 1) | (prompt_len >= lengths))[0]
    if len(bad):
        raise DistilledDataError(
            f"distilled dataset {name}: row {int(bad[0])} has prompt_len {int(prompt_len[bad[0]])} "
            f"but {int(lengths[bad[0]])} tokens; every row needs a prompt and a response"
        )
