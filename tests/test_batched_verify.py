"""Several requests' trees verified in one forward give each request its own output.

Requests differ in prompt length, tree, speculation on/off, greedy/sampled, and finish at
different steps, so the batch is ragged in cache length and tree size and shrinks as it runs.
Models are redrawn at a larger scale (as in test_generation.py) so outputs are varied and top-2
gaps are well above float noise.
"""

from __future__ import annotations

import functools
from dataclasses import replace

import pytest
import torch
from batched_streams import run_batched
from tiny_models import ARCHS, make_tiny_model

from selfspec import batched_verify
from selfspec.batched_verify import verify_features
from selfspec.generation import GenerationConfig, SpeculativeGenerator
from selfspec.heads import build_heads, heads_config_for
from selfspec.kernels import extension
from selfspec.kernels.modules import install_kernels
from selfspec.prefill import run_prefill_chunk
from selfspec.sampling import SamplingParams
from selfspec.tree import DynamicTree, StaticTree

PROMPTS = ([1, 23, 5, 61, 8, 30], [1, 7, 44, 9, 12, 70, 3, 18, 52, 26, 11], [1, 90])
NO_STOP: tuple[int, ...] = ()


@functools.cache
def _generator(arch: str, kind: str) -> SpeculativeGenerator:
    model = make_tiny_model(arch, seed=0)
    generator = torch.Generator().manual_seed(ARCHS.index(arch))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() >= 2:
                big = any(part in name for part in ("embed", "wte", "wpe", "lm_head"))
                param.copy_(torch.randn(param.shape, generator=generator) * (0.5 if big else 0.2))
        heads = build_heads(heads_config_for(model, kind))
        for param in heads.parameters():
            param.add_(torch.randn(param.shape, generator=generator) * 0.1)
    return SpeculativeGenerator(model, heads.eval())


def _configs() -> list[GenerationConfig]:
    return [
        GenerationConfig(
            max_new_tokens=20, tree=DynamicTree(top_k=3, depth=3, budget=9), stop_token_ids=NO_STOP
        ),
        GenerationConfig(max_new_tokens=13, tree=StaticTree.chain(2), stop_token_ids=NO_STOP),
        GenerationConfig(max_new_tokens=17, speculate=False, stop_token_ids=NO_STOP),
    ]


@pytest.mark.parametrize("kind", ["eagle", "medusa"])
@pytest.mark.parametrize("arch", ARCHS)
def test_batched_greedy_equals_each_request_alone(arch: str, kind: str) -> None:
    generator = _generator(arch, kind)
    configs = _configs()
    alone = [generator.generate(p, c).token_ids for p, c in zip(PROMPTS, configs, strict=True)]
    streams = [generator.stream(p, c) for p, c in zip(PROMPTS, configs, strict=True)]
    run_batched(streams)
    together = [s.result.token_ids for s in streams]
    assert together == alone
    assert [len(t) for t in together] == [20, 13, 17]  # ragged: the batch shrank as rows finished
    assert len(set(map(tuple, together))) == 3


def test_batched_sampling_equals_each_request_alone() -> None:
    """Seeded sampling consumes each request's own generator the same way in a batch."""
    generator = _generator("llama", "eagle")
    sampled = SamplingParams(temperature=0.9, top_k=20)
    configs = [
        GenerationConfig(max_new_tokens=15, sampling=sampled, seed=seed, stop_token_ids=NO_STOP)
        for seed in (3, 4, 5)
    ]
    alone = [generator.generate(p, c).token_ids for p, c in zip(PROMPTS, configs, strict=True)]
    streams = [generator.stream(p, c) for p, c in zip(PROMPTS, configs, strict=True)]
    run_batched(streams)
    assert [s.result.token_ids for s in streams] == alone


def test_batched_features_and_cache_match_a_forward_of_its_own() -> None:
    generator = _generator("qwen2", "eagle")
    config = GenerationConfig(
        max_new_tokens=8, tree=DynamicTree(top_k=2, depth=2, budget=5), stop_token_ids=NO_STOP
    )
    pairs = []
    for prompt in PROMPTS:
        batched, alone = generator.stream(prompt, config), generator.stream(prompt, config)
        batched.start(), alone.start()
        pairs.append((batched, alone))
    drafted = [b.draft() for b, _ in pairs]
    with torch.inference_mode():
        features = verify_features(
            generator.target, [(b.state, d) for (b, _), d in zip(pairs, drafted, strict=True)]
        )
        for (_, alone), step, got in zip(pairs, drafted, features, strict=True):
            state = alone.state
            want = generator.target.features(
                step.tree.tokens[None],
                step.buffers.position_ids,
                state.cache,
                step.buffers.attention_mask,
            )[0]
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for (batched, alone), _ in zip(pairs, drafted, strict=True):
        for own, reference in zip(
            batched.state.cache.layers, alone.state.cache.layers, strict=True
        ):
            assert own.keys.shape == reference.keys.shape
            torch.testing.assert_close(own.keys, reference.keys, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(own.values, reference.values, rtol=1e-5, atol=1e-5)


def test_an_unconcluded_step_is_refused() -> None:
    generator = _generator("llama", "eagle")
    stream = generator.stream(PROMPTS[0], _configs()[0])
    stream.start()
    step = stream.draft()
    with torch.inference_mode():
        verify_features(generator.target, [(stream.state, step)])
        with pytest.raises(ValueError, match="not concluded"):
            verify_features(generator.target, [(stream.state, step)])


@pytest.mark.parametrize("kind", ["eagle", "medusa"])
def test_steps_without_drafts_leave_greedy_output_unchanged(kind: str) -> None:
    """The server's speculation gate skips drafting in some rounds: a speculating request's
    step then verifies its root alone (without context drafts), and the draft state still
    follows the output."""
    generator = _generator("llama", kind)
    config = replace(_configs()[0], context_drafts=None)
    alone = generator.generate(PROMPTS[0], config).token_ids
    stream = generator.stream(PROMPTS[0], config)
    assert stream.trees_may_vary
    stream.start()
    sizes, step = [], 0
    while not stream.done:
        drafted = stream.draft(speculate=step % 3 != 1)  # every third step without drafts
        sizes.append(drafted.tree.size)
        with torch.inference_mode():
            features = verify_features(stream.owner.target, [(stream.state, drafted)])
        stream.conclude(drafted, features[0])
        step += 1
    assert stream.result.token_ids == alone
    assert sizes[1] == 1 and max(sizes) > 1
    seeded = GenerationConfig(sampling=SamplingParams(temperature=1.0), seed=3)
    assert not generator.stream(PROMPTS[0], seeded).trees_may_vary


def test_steps_without_heads_drafts_still_offer_the_context_chain() -> None:
    """Where the heads rest, the step verifies the root and the context chain (a tree of its own,
    no heads call); the draft state is left to catch up, and the output is unchanged."""
    generator = _generator("llama", "eagle")
    config = _configs()[0]
    stream = generator.stream(PROMPTS[0], config)
    stream.start()
    chained = 0
    while not stream.done:
        drafted = stream.draft(speculate=False)
        assert not drafted.drafted
        if drafted.tree.size > 1:
            chained += 1
            tree = drafted.tree
            assert tree.parents.tolist() == list(range(-1, tree.size - 1))  # one chain
            assert tree.size - 1 <= min(config.tree.depth, len(drafted.context[0].tokens))
        with torch.inference_mode():
            features = verify_features(stream.owner.target, [(stream.state, drafted)])
        stream.conclude(drafted, features[0])
    assert chained
    assert stream.state.draft_state is None  # the heads never started
    assert stream.result.token_ids == generator.generate(PROMPTS[0], config).token_ids


def _draft_length(state: object) -> int:
    """Committed entries the draft state holds: EAGLE's cache length; Medusa keeps one feature."""
    cache = getattr(state, "cache", None)
    return cache.length if cache is not None else 1


def test_steps_without_drafts_defer_the_draft_advance() -> None:
    """A step that does not draft leaves the draft state alone; the next step that drafts first
    catches up over every skipped step in one advance, to the state that advancing each step
    would have reached."""
    generator = _generator("llama", "eagle")
    config = replace(_configs()[0], context_drafts=None)
    every, skipping = generator.stream(PROMPTS[0], config), generator.stream(PROMPTS[0], config)
    every.start(), skipping.start()
    for step in range(6):
        speculate = step in (0, 4)
        for stream, own in ((every, True), (skipping, speculate)):
            drafted = stream.draft(speculate=own)
            if not own:
                assert not drafted.drafted and drafted.tree.size == 1
            with torch.inference_mode():
                features = verify_features(stream.owner.target, [(stream.state, drafted)])
            stream.conclude(drafted, features[0])
        if step in (1, 2, 3):
            assert len(skipping.state.deferred_advance) == step  # nothing advanced yet
        if step == 4:  # drafted: caught up first, then advanced over its own step
            assert skipping.state.deferred_advance == []
            assert _draft_length(skipping.state.draft_state) == skipping.state.committed_len
    assert _draft_length(every.state.draft_state) == every.state.committed_len


def test_deferred_advances_are_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    """However long drafting stays off, a request holds at most MAX_DEFERRED_TOKENS deferred
    tokens: then it catches up anyway."""
    monkeypatch.setattr("selfspec.generation.MAX_DEFERRED_TOKENS", 4)
    generator = _generator("llama", "eagle")
    stream = generator.stream(PROMPTS[1], _configs()[0])
    stream.start()
    lengths = []
    while not stream.done:
        drafted = stream.draft(speculate=False)
        with torch.inference_mode():
            features = verify_features(stream.owner.target, [(stream.state, drafted)])
        stream.conclude(drafted, features[0])
        if not stream.done:
            assert sum(len(t) for _, t in stream.state.deferred_advance) < 4
            draft_state = stream.state.draft_state  # None until it first catches up
            lengths.append(0 if draft_state is None else _draft_length(draft_state))
    assert len(set(lengths)) > 1  # it did catch up along the way
    assert stream.result.token_ids == generator.generate(PROMPTS[1], _configs()[0]).token_ids


@pytest.mark.skipif(extension.load() is None, reason="the C++ kernels are not built here")
@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
def test_rows_over_their_own_caches_give_the_stacked_and_the_lone_bits(
    arch: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On the kernels the trees run back to back (ragged: no padding) over each request's own
    cache (nothing stacked, one whole-body call); features and caches equal those of the same
    trees padded into the stacked batch, and of each request's forward of its own, bit for bit
    (the kernels are row-invariant)."""
    model = make_tiny_model(arch, seed=0).eval()
    install_kernels(model, "float32")
    heads = build_heads(heads_config_for(model, "eagle")).eval()
    generator = SpeculativeGenerator(model, heads)
    configs = _configs()  # trees of different sizes, and none

    def verified(layout: str) -> tuple:
        streams = [generator.stream(p, c) for p, c in zip(PROMPTS, configs, strict=True)]
        for stream in streams:
            stream.start()
        drafted = [stream.draft() for stream in streams]
        assert len({step.tree.size for step in drafted}) > 1  # padding would be needed
        calls: list[tuple] = []
        with torch.inference_mode(), monkeypatch.context() as patch:
            if layout == "stacked":
                patch.setattr(batched_verify, "_ragged_forward", lambda *args: None)
            original = generator.target.lean.rows_forward

            def recorded(*args, **kwargs):
                out = original(*args, **kwargs)
                calls.append((args[0].shape, out is not None))
                return out

            patch.setattr(generator.target.lean, "rows_forward", recorded)
            features = verify_features(
                generator.target, [(s.state, d) for s, d in zip(streams, drafted, strict=True)]
            )
        nodes = sum(step.tree.size for step in drafted)
        assert calls == ([((1, nodes), True)] if layout == "ragged" else [])
        caches = [
            (layer.keys.clone(), layer.values.clone())
            for stream in streams
            for layer in stream.state.cache.layers
        ]
        return features, caches, drafted

    own, own_caches, drafted = verified("ragged")
    stacked, stacked_caches, _ = verified("stacked")
    for a, b in zip(
        own + [t for pair in own_caches for t in pair],
        stacked + [t for pair in stacked_caches for t in pair],
        strict=True,
    ):
        assert torch.equal(a, b)
    alone = []
    with torch.inference_mode():
        for prompt, config, step in zip(PROMPTS, configs, drafted, strict=True):
            stream = generator.stream(prompt, config)
            stream.start()
            alone.append(
                generator.target.features(
                    step.tree.tokens[None],
                    step.buffers.position_ids,
                    stream.state.cache,
                    step.buffers.attention_mask,
                )[0]
            )
    for got, want in zip(own, alone, strict=True):
        assert torch.equal(got, want)


@pytest.mark.skipif(extension.load() is None, reason="the C++ kernels are not built here")
@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
def test_prefill_chunks_share_the_forward_with_the_trees(kind: str) -> None:
    """A prefilling request's chunk runs back to back with the others' trees: its features,
    tapped layer states (EAGLE-3) and cache entries equal those of the chunk's forward of its
    own, bit for bit; the trees' are unchanged, and so is the finished prefill's first token."""
    model = make_tiny_model("llama", seed=0).eval()
    install_kernels(model, "float32")
    heads = build_heads(heads_config_for(model, kind)).eval()
    generator = SpeculativeGenerator(model, heads)
    configs = _configs()[:2]
    long_prompt = [1, *range(20, 33)]  # 14 tokens: chunks of 5, 5, 4

    def run(shared: bool) -> tuple:
        streams = [generator.stream(p, c) for p, c in zip(PROMPTS[:2], configs, strict=True)]
        for stream in streams:
            stream.start()
        drafted = [stream.draft() for stream in streams]
        late = generator.stream(long_prompt, configs[0])
        late.prefill(5)  # the first chunk alone; the next one shares the forward
        progress, chunk = late.next_prefill_chunk(5)
        with torch.inference_mode():
            if shared:
                verified = batched_verify.verify_rows(
                    generator.target,
                    [(s.state, d) for s, d in zip(streams, drafted, strict=True)],
                    [(progress, chunk)],
                )
                assert verified.forward_tokens == sum(d.tree.size for d in drafted) + 5
                trees, (own, tapped) = verified.features, verified.prefills[0]
            else:
                trees = verify_features(
                    generator.target, [(s.state, d) for s, d in zip(streams, drafted, strict=True)]
                )
                own, tapped = run_prefill_chunk(generator.target, progress, chunk)
        assert late.absorb_prefill(chunk, own, tapped, 0.0) is None
        first = late.prefill()  # the last chunk alone: the first token
        cache = [(layer.keys.clone(), layer.values.clone()) for layer in late.state.cache.layers]
        return trees, own, tapped, cache, first.token_ids

    shared, apart = run(shared=True), run(shared=False)
    assert (shared[2] is not None) == (kind == "eagle3")
    for a, b in zip(shared[0] + [shared[1]], apart[0] + [apart[1]], strict=True):
        assert torch.equal(a, b)
    if kind == "eagle3":
        assert torch.equal(shared[2], apart[2])
    for (keys_a, values_a), (keys_b, values_b) in zip(shared[3], apart[3], strict=True):
        assert torch.equal(keys_a, keys_b) and torch.equal(values_a, values_b)
    assert shared[4] == apart[4]
