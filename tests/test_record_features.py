"""Features recorded while decoding (``GenerationConfig.record_features``): the target's last
hidden state at every position of prompt and output but the last, the rows a drafter trains on,
equal to a teacher-forced forward over the same tokens; the output itself unchanged."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from tiny_models import make_tiny_model

from selfspec.generation import GenerationConfig, SpeculativeGenerator
from selfspec.heads import build_heads, heads_config_for
from selfspec.tree import DynamicTree

PROMPT = [1, 23, 5, 61, 8, 30, 12]


@pytest.fixture(scope="module")
def generator() -> SpeculativeGenerator:
    torch.manual_seed(0)
    model = make_tiny_model("llama", 0)
    with torch.no_grad():  # livelier than the default init: varied text, many steps
        for param in model.parameters():
            if param.dim() >= 2:
                param.normal_(0, 0.3)
    heads = build_heads(heads_config_for(model, "eagle")).eval()
    return SpeculativeGenerator(model, heads, tokenizer=None)


@pytest.mark.parametrize("stop", [(), "mid"])
def test_recorded_features_are_the_teacher_forced_hidden_states(generator, stop) -> None:
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
    with torch.no_grad():
        hidden = generator.target.model.get_decoder()(ids).last_hidden_state[0, :-1]
    features = recorded.features
    assert features.dtype == torch.float16
    assert features.shape == (len(PROMPT) + len(recorded.token_ids) - 1, hidden.shape[-1])
    torch.testing.assert_close(features.float(), hidden, atol=2e-2, rtol=1e-2)


def test_nothing_is_recorded_without_speculation(generator) -> None:
    config = GenerationConfig(max_new_tokens=8, speculate=False, record_features=True)
    assert generator.generate(PROMPT, config).features is None
