"""Prompt prefixes reused across requests: the same tokens and log-probabilities as a full
prefill (bit for bit on the row-invariant kernels), for vanilla, EAGLE and EAGLE-3 requests;
namespaces kept apart; LRU eviction within the byte bound; dropping a namespace."""

from __future__ import annotations

import pytest
import torch
from tiny_models import save_tiny_target

from selfspec.generation import GenerationConfig, SpeculativeGenerator
from selfspec.heads import build_heads, heads_config_for
from selfspec.prefix_cache import PrefixCache, PrefixCacheConfig
from selfspec.target import TargetSpec, load_target
from selfspec.tree import DynamicTree

SYSTEM = [(7 * i + 3) % 90 + 5 for i in range(100)]  # a shared 100-token "system prompt"


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory):
    path = save_tiny_target(tmp_path_factory.mktemp("prefix") / "tiny")
    return load_target(TargetSpec(model=str(path)))


def _generator(target, kind: str | None) -> SpeculativeGenerator:
    heads = None
    if kind is not None:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            heads = build_heads(heads_config_for(target.model, kind))
            with torch.no_grad():
                for param in heads.parameters():
                    param.add_(torch.randn_like(param) * 0.05)
    return SpeculativeGenerator(target.model, heads, target.tokenizer)


def _run(generator, prompt: list[int], namespace: str | None, speculate: bool):
    config = GenerationConfig(
        max_new_tokens=24,
        logprobs=2,
        speculate=speculate,
        tree=DynamicTree(),
        prefix_namespace=namespace,
    )
    return generator.generate(prompt, config)


@pytest.mark.parametrize("kind", [None, "eagle", "eagle3"])
def test_reused_prefixes_give_the_same_tokens_and_logprobs(target, kind: str | None) -> None:
    plain = _generator(target, kind)
    cached = _generator(target, kind)
    cached.prefix_cache = PrefixCache(PrefixCacheConfig(block_tokens=32))
    speculate = kind is not None
    for suffix in ([11, 12, 13], [21, 22, 23, 24, 25], [11, 12, 13]):
        prompt = SYSTEM + suffix
        want = _run(plain, prompt, None, speculate)
        got = _run(cached, prompt, "base", speculate)
        assert got.token_ids == want.token_ids
        got_lp = torch.tensor([x.logprob for x in got.logprobs])
        want_lp = torch.tensor([x.logprob for x in want.logprobs])
        if cached.prefix_cache_exact:
            assert torch.equal(got_lp, want_lp)
        else:
            torch.testing.assert_close(got_lp, want_lp, rtol=0, atol=1e-5)
    stats = cached.prefix_cache.stats
    assert stats.misses == 1 and stats.hits == 2 and stats.hit_tokens == 2 * 96
    # The third prompt is fully cached but for its last token: 3 blocks of 32 of 103 tokens.


def test_the_kernels_make_reuse_exact(target) -> None:
    from selfspec.kernels.modules import uses_kernels

    assert _generator(target, None).prefix_cache_exact == uses_kernels(target.model.get_decoder())


def test_namespaces_are_kept_apart_and_dropped(target) -> None:
    generator = _generator(target, None)
    cache = generator.prefix_cache = PrefixCache()
    _run(generator, SYSTEM + [1], "attn", False)
    _run(generator, SYSTEM + [2], "mlp", False)  # another adapter: no hit
    assert cache.stats.hits == 0 and cache.stats.misses == 2
    _run(generator, SYSTEM + [3], "attn", False)
    assert cache.stats.hits == 1
    cache.drop("attn")
    _run(generator, SYSTEM + [4], "attn", False)
    assert cache.stats.hits == 1 and cache.stats.misses == 3
    _run(generator, SYSTEM + [5], None, False)  # no namespace: no reuse, nothing stored
    assert cache.stats.misses == 3


def test_eviction_keeps_the_cache_within_its_bound(target) -> None:
    generator = _generator(target, None)
    probe = generator.prefix_cache = PrefixCache(PrefixCacheConfig(block_tokens=16))
    _run(generator, SYSTEM[:33], "base", False)  # two blocks
    block_bytes = probe.nbytes // 2
    cache = generator.prefix_cache = PrefixCache(
        PrefixCacheConfig(max_bytes=5 * block_bytes, block_tokens=16)
    )
    _run(generator, SYSTEM[:50] + [1], "base", False)  # three blocks
    _run(generator, [9] * 49 + [1], "other", False)  # three more: the first chain's deepest go
    assert cache.nbytes <= 5 * block_bytes and cache.stats.evicted_blocks == 1
    _run(generator, SYSTEM[:50] + [2], "base", False)
    assert cache.stats.hit_tokens == 32  # blocks 1-2 of the first chain survived, block 3 not


def test_prompt_logprobs_bypass_the_cache(target) -> None:
    generator = _generator(target, None)
    cache = generator.prefix_cache = PrefixCache()
    config = GenerationConfig(max_new_tokens=2, logprobs=0, prompt_logprobs=True,
                              prefix_namespace="base", speculate=False)  # fmt: skip
    generator.generate(SYSTEM, config)
    result = generator.generate(SYSTEM, config)
    assert cache.stats.hits == 0 and len(result.prompt_logprobs) == len(SYSTEM)


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="block_tokens >= 1"):
        PrefixCacheConfig(block_tokens=0)
