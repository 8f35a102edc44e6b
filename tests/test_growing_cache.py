"""GrowingLayer: the same keys and values as transformers' DynamicLayer through every operation
selfspec and transformers apply to a cache, with appends that write only the new entries."""

from __future__ import annotations

import torch
from tiny_models import make_tiny_model, tiny_config
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from selfspec.growing_cache import MIN_CAPACITY, GrowingLayer, growing_cache, supports_growing
from selfspec.kv_commit import commit_accepted, drop_uncommitted
from selfspec.target_forward import TargetForward


def _states(length: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return (
        torch.randn(1, 2, length, 4, generator=generator),
        torch.randn(1, 2, length, 4, generator=generator),
    )


def _same(a: DynamicLayer, b: GrowingLayer) -> None:
    assert a.get_seq_length() == b.get_seq_length()
    assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)


def test_appends_crops_and_commits_match_the_dynamic_layer() -> None:
    plain, growing = DynamicLayer(), GrowingLayer()
    for layer in (plain, growing):
        layer.update(*_states(5, 0))
    _same(plain, growing)
    capacity = growing._key_buffer.shape[-2]
    for step in range(40):  # past the first capacity: the buffer doubles
        new = _states(1 + step % 4, step + 1)
        for layer in (plain, growing):
            layer.update(*new)
        _same(plain, growing)
        if step % 3 == 0:
            for layer in (plain, growing):
                layer.crop(-2)
            _same(plain, growing)
    assert growing._key_buffer.shape[-2] > capacity >= MIN_CAPACITY


def test_a_tree_committed_out_of_order_keeps_the_accepted_entries_in_path_order() -> None:
    config = tiny_config("llama")
    caches = [DynamicCache(config=config), growing_cache(config)]
    for cache in caches:
        for index in range(len(cache.layers)):
            cache.update(*_states(7, index), index)
    accepted = torch.tensor([0, 2, 3])  # of 4 tree entries after 3 committed
    for cache in caches:
        commit_accepted(cache, committed_len=3, accepted=accepted)
    for plain, growing in zip(*(c.layers for c in caches), strict=True):
        _same(plain, growing)
        assert growing.get_seq_length() == 6
    for cache in caches:
        for index in range(len(cache.layers)):
            cache.update(*_states(2, 9), index)
        drop_uncommitted(cache, 6)
    for plain, growing in zip(*(c.layers for c in caches), strict=True):
        _same(plain, growing)


def test_an_append_writes_in_place_and_a_crop_keeps_the_buffer() -> None:
    layer = GrowingLayer()
    layer.update(*_states(3, 0))
    buffer = layer._key_buffer
    layer.update(*_states(1, 1))
    layer.crop(-2)
    layer.update(*_states(1, 2))
    assert layer._key_buffer is buffer and layer.get_seq_length() == 3
    assert layer.keys.data_ptr() == buffer.data_ptr()  # a view, no copy


def test_assigned_tensors_and_resets_behave_like_the_dynamic_layer() -> None:
    plain, growing = DynamicLayer(), GrowingLayer()
    for layer in (plain, growing):
        layer.update(*_states(4, 0))
        layer.batch_repeat_interleave(3)
        layer.batch_select_indices(torch.tensor([0, 2]))
        layer.update(*(torch.cat([s, s]) for s in _states(1, 1)))
    _same(plain, growing)
    growing.reset()
    assert growing.get_seq_length() == 0 and growing.keys is None
    growing.update(*_states(2, 3))
    assert growing.get_seq_length() == 2


def test_the_target_gets_growing_caches_and_decodes_the_same_tokens() -> None:
    model = make_tiny_model("llama").eval()
    target = TargetForward(model)
    assert supports_growing(model.config)
    cache = target.new_cache()
    assert all(type(layer) is GrowingLayer for layer in cache.layers)
    with torch.no_grad():
        ids = torch.tensor([[1, 5, 9, 2]])
        expected = model.generate(ids, max_new_tokens=12, do_sample=False)[0, 4:].tolist()
        positions = torch.arange(4)[None]
        got = []
        hidden = target.features(ids, positions, cache)
        for step in range(12):
            token = int(target.logits(hidden[:, -1]).argmax(-1))
            got.append(token)
            hidden = target.features(torch.tensor([[token]]), torch.tensor([[4 + step]]), cache)
    assert got == expected
