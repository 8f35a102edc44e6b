"""Several requests drafted in one heads call (``GenerationStream.draft_together``, EAGLE's
``draft_many``): on the fused head every row reads its own cache, so each request's tree is the
one it drafts alone, bit for bit, whatever the other requests' cache lengths and frontiers
(EAGLE and EAGLE-3 heads); on
the torch path the requests' growths still run in lock step, each head call on its own."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from test_exact_speculation import kernel_model
from test_fused_head import random_head

from selfspec.drafting.base import AdvanceRequest
from selfspec.drafting.fused_head import FusedEagleHead
from selfspec.generation import GenerationConfig, GenerationStream, SpeculativeGenerator
from selfspec.tree import DynamicTree

PROMPTS = [[5, 9, 13, 2, 7], [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5], [8, 8, 2]]


def _generator(kind: str = "eagle") -> SpeculativeGenerator:
    model = kernel_model("llama", "float32")
    return SpeculativeGenerator(model, random_head(model, kind, layers=2))


@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
def test_requests_drafted_together_get_the_trees_they_draft_alone(
    kernel_path: str, kind: str, monkeypatch
) -> None:
    generator = _generator(kind)
    config = GenerationConfig(
        max_new_tokens=24, tree=DynamicTree(top_k=3, depth=4, budget=9), stop_token_ids=()
    )
    rows_seen: list[int] = []
    real_rows = FusedEagleHead.rows

    def rows(self, token_embeds, *args):
        out = real_rows(self, token_embeds, *args)
        rows_seen.append(0 if out is None else token_embeds.shape[0])
        return out

    monkeypatch.setattr(FusedEagleHead, "rows", rows)
    alone = [generator.stream(prompt, config) for prompt in PROMPTS]
    together = [generator.stream(prompt, config) for prompt in PROMPTS]
    for stream in alone + together:
        stream.start()
    for _ in range(4):
        own = [stream.draft() for stream in alone]
        shared = GenerationStream.draft_together(together, 1, [True] * 3, [False] * 3)
        for a, b in zip(own, shared, strict=True):
            assert a.tree.size > 2
            for name in ("tokens", "parents", "depths", "scores", "draws"):
                assert torch.equal(getattr(a.tree, name), getattr(b.tree, name)), name
        for stream, step in zip(alone, own, strict=True):
            stream.verify(step)
        for stream, step in zip(together, shared, strict=True):
            stream.verify(step)
    fused = kernel_path != "torch"  # on the torch path each request runs the head alone
    assert max(rows_seen) == (len(PROMPTS) if fused else 0), rows_seen
    for a, b in zip(alone, together, strict=True):
        assert a.state.token_ids == b.state.token_ids
        assert a.state.draft_state.cache.lengths == b.state.draft_state.cache.lengths


def test_drafting_together_keeps_the_output_and_skips_non_speculating_rows(
    kernel_path: str,
) -> None:
    generator = _generator()
    tree = DynamicTree(top_k=3, depth=3, budget=6)
    config = GenerationConfig(max_new_tokens=20, tree=tree, stop_token_ids=())
    vanilla = [generator.generate(p, replace(config, speculate=False)).token_ids for p in PROMPTS]
    streams = [generator.stream(prompt, config) for prompt in PROMPTS]
    for stream in streams:
        stream.start()
    rounds = 0
    while not all(stream.done for stream in streams):
        running = [stream for stream in streams if not stream.done]
        speculate = [rounds % 2 == 0 or i != 1 for i in range(len(running))]
        steps = GenerationStream.draft_together(
            running, len(running), speculate, [False] * len(running)
        )
        for stream, step, own in zip(running, steps, speculate, strict=True):
            # A row that does not draft verifies its root, and its context chain if any.
            offered = sum(len(chain.tokens) for chain in step.context)
            assert step.drafted == own and (own or step.tree.size <= 1 + offered)
            stream.verify(step)
        rounds += 1
    assert [stream.result.token_ids for stream in streams] == vanilla


@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
def test_paths_advanced_together_give_the_draft_states_of_advancing_alone(
    kernel_path: str, kind: str
) -> None:
    drafter = _generator(kind).drafter
    width = drafter.head.config.hidden_size * len(getattr(drafter, "target_layers", ()) or [1])
    generator = torch.Generator().manual_seed(3)

    def states():
        return [
            drafter.start(torch.randn(len(p), width, generator=g), torch.tensor(p), 7)
            for p, g in ((p, torch.Generator().manual_seed(i)) for i, p in enumerate(PROMPTS))
        ]

    alone, together = states(), states()
    with torch.inference_mode():
        for _ in range(3):
            paths = [  # accepted paths of different lengths, root first
                (torch.randn(n, width, generator=generator), torch.randint(0, 50, (n,)), 11 + n)
                for n in (1, 4, 2)
            ]
            for state, (features, tokens, bonus) in zip(alone, paths, strict=True):
                drafter.advance(state, features, tokens, bonus)
            drafter.advance_many(
                [AdvanceRequest(s, *path) for s, path in zip(together, paths, strict=True)]
            )
    for a, b in zip(alone, together, strict=True):
        assert a.cache.lengths == b.cache.lengths
        assert torch.equal(a.root_feature, b.root_feature)
        for x, y in zip(a.cache.keys + a.cache.values, b.cache.keys + b.cache.values, strict=True):
            assert torch.equal(x, y)
