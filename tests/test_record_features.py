"""Features recorded while decoding (``GenerationConfig.record_features``): the target's last
hidden state at every position of prompt and output but the last, the rows a drafter trains on,
equal to a teacher-forced forward over the same tokens; the output itself unchanged."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from tiny_models import make_tiny_model

from selfspec.generation import GenerationConfig, SpeculativeGenerator, split_recorded
from selfspec.heads import build_heads, heads_config_for
from selfspec.tree import DynamicTree

PROMPT = [1, 23, 5, 61, 8, 30, 12]


@pytest.fixture(scope="module", params=["eagle", "eagle3"])
def generator(request) -> SpeculativeGenerator:
    torch.manual_seed(0)
    model = make_tiny_model("llama", 0)
    with torch.no_grad():  # livelier than the default init: varied text, many steps
        for param in model.parameters():
            if param.dim() >= 2:
                param.normal_(0, 0.3)
    heads = build_heads(heads_config_for(model, request.param)).eval()
    return SpeculativeGenerator(model, heads, tokenizer=None)


@pytest.mark.parametrize("stop", [(), "mid"])
def test_recorded_features_are_the_teacher_forced_hidden_states(generator, stop) -> None:
    """EAGLE-3 heads: each position also keeps the states entering their layers, first."""
    config = GenerationConfig(
        max_new_tokens=30, stop_token_ids=(), tree=DynamicTree(top_k=3, depth=4, budget=10)
    )
    plain = generator.generate(PROMPT, config)
    if stop == "mid":  # a stop token cuts the output: the features follow the kept tokens
        config = GenerationConfig(
            max_new_tokens=30, stop_token_ids=(plain.token_ids[11],), tree=config.tree
        )
        plain = generator.generate(PROMPT, config)
    recorded = generator.generate(PROMPT, replace(config, record_features=True))
    assert recorded.token_ids == plain.token_ids and plain.features is None
    assert len(recorded.stats.steps) > 3  # several verification steps contributed rows
    ids = torch.tensor([PROMPT + recorded.token_ids])  # [1, S + N]
    layers = tuple(generator.heads.config.target_layers)  # () but for EAGLE-3
    with torch.no_grad():
        states = generator.target.model(ids, output_hidden_states=True).hidden_states
    hidden = states[-1][0, :-1]  # [S + N - 1, H]
    features = recorded.features
    assert features.dtype == torch.float16
    assert features.shape == (ids.shape[1] - 1, (len(layers) + 1) * hidden.shape[-1])
    tapped, last = split_recorded(features, len(layers))
    torch.testing.assert_close(last.float(), hidden, atol=2e-2, rtol=1e-2)
    if layers:
        expected = torch.cat([states[k][0, :-1] for k in layers], dim=-1)  # [S + N - 1, k*H]
        torch.testing.assert_close(tapped.float(), expected, atol=2e-2, rtol=1e-2)
    else:
        assert tapped is None


def test_nothing_is_recorded_without_speculation(generator) -> None:
    config = GenerationConfig(max_new_tokens=8, speculate=False, record_features=True)
    assert generator.generate(PROMPT, config).features is None
