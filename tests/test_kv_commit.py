"""KV commit: after verification only the accepted path's tree entries stay, in path order."""

from __future__ import annotations

import pytest
import torch
from tiny_models import tiny_config
from transformers import DynamicCache, MistralConfig

from selfspec.growing_cache import GrowingLayer
from selfspec.kv_commit import commit_accepted

LAYERS, HEADS, HEAD_DIM = 2, 2, 4
COMMITTED, TREE = 5, 7


def _entries(layer: int, start: int, count: int, offset: float) -> torch.Tensor:
    """Entries whose every value names (layer, position): # [1, heads, count, head_dim]"""
    positions = torch.arange(start, start + count, dtype=torch.float32)
    values = 1000.0 * layer + positions + offset
    return values.view(1, 1, count, 1).expand(1, HEADS, count, HEAD_DIM).clone()


def _cache(growing: bool = False) -> DynamicCache:
    """A committed prefix, then one tree's entries appended in a second update (as in decoding).
    Keys hold layer * 1000 + position, values the same + 0.5. ``growing``: layers that grow in
    place (``GrowingLayer``, what decoding uses), else transformers' own."""
    cache = DynamicCache()
    if growing:
        cache.layers = [GrowingLayer() for _ in range(LAYERS)]
    for start, count in ((0, COMMITTED), (COMMITTED, TREE)):
        for layer in range(LAYERS):
            cache.update(
                _entries(layer, start, count, 0.0), _entries(layer, start, count, 0.5), layer
            )
    return cache


def _expected(layer: int, accepted: list[int], offset: float) -> torch.Tensor:
    prefix = _entries(layer, 0, COMMITTED, offset)
    tree = _entries(layer, COMMITTED, TREE, offset)
    return torch.cat([prefix, tree[:, :, accepted]], dim=2)


@pytest.mark.parametrize(
    "accepted",
    [
        [0],  # nothing drafted accepted (also vanilla decoding)
        [0, 1, 2],  # contiguous: a chain prefix
        [0, 1, 2, 3, 4, 5, 6],  # every node accepted (a full chain): no entry dropped
        [0, 2, 5],  # a later sibling, then a deeper node
        [0, 3, 4, 6],  # non-contiguous, starting after a gap
        [0, 1, 6],  # a gap in the middle
    ],
)
@pytest.mark.parametrize("growing", [False, True], ids=["dynamic", "growing"])
def test_commit_keeps_exactly_the_accepted_entries_in_order(
    accepted: list[int], growing: bool
) -> None:
    cache = _cache(growing)
    commit_accepted(cache, COMMITTED, torch.tensor(accepted))
    assert cache.get_seq_length() == COMMITTED + len(accepted)
    for layer_index, layer in enumerate(cache.layers):
        assert torch.equal(layer.keys, _expected(layer_index, accepted, 0.0))
        assert torch.equal(layer.values, _expected(layer_index, accepted, 0.5))


@pytest.mark.parametrize("growing", [False, True], ids=["dynamic", "growing"])
def test_commit_then_append_continues_after_the_accepted_path(growing: bool) -> None:
    cache = _cache(growing)
    commit_accepted(cache, COMMITTED, torch.tensor([0, 2, 5]))
    new = _entries(0, 100, 3, 0.0)
    keys, _ = cache.update(new, new + 0.5, 0)
    assert torch.equal(keys[:, :, : COMMITTED + 3], _expected(0, [0, 2, 5], 0.0))
    assert torch.equal(keys[:, :, COMMITTED + 3 :], new)


@pytest.mark.parametrize("growing", [False, True], ids=["dynamic", "growing"])
def test_commit_twice_in_a_row(growing: bool) -> None:
    cache = _cache(growing)
    commit_accepted(cache, COMMITTED, torch.tensor([0, 4]))
    committed = COMMITTED + 2
    for layer in range(LAYERS):
        cache.update(_entries(layer, 50, 4, 0.0), _entries(layer, 50, 4, 0.5), layer)
    commit_accepted(cache, committed, torch.tensor([0, 3]))
    for layer_index, layer in enumerate(cache.layers):
        expected = torch.cat(
            [
                _expected(layer_index, [0, 4], 0.0),
                _entries(layer_index, 50, 4, 0.0)[:, :, [0, 3]],
            ],
            dim=2,
        )
        assert torch.equal(layer.keys, expected)


def test_sliding_window_cache_is_refused() -> None:
    config = tiny_config("mistral")
    assert isinstance(config, MistralConfig)
    config.sliding_window = 4
    cache = DynamicCache(config=config)
    for layer in range(config.num_hidden_layers):
        cache.update(_entries(layer, 0, 3, 0.0), _entries(layer, 0, 3, 0.5), layer)
    with pytest.raises(TypeError, match="DynamicCache"):
        commit_accepted(cache, 1, torch.tensor([0]))
