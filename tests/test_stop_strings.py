"""Stop strings end generation, cut the text before the stop string, and stream consistently."""

from __future__ import annotations

import pytest
from tiny_models import make_tiny_model, make_tiny_tokenizer

from selfspec.generation import FinishReason, GenerationConfig, SpeculativeGenerator
from selfspec.heads import build_heads, heads_config_for

PROMPT_TEXT = "hello world"


def _generators():
    model = make_tiny_model("llama", seed=4)
    tokenizer = make_tiny_tokenizer()
    heads = build_heads(heads_config_for(model, "eagle")).eval()
    return SpeculativeGenerator(model, None, tokenizer), SpeculativeGenerator(
        model, heads, tokenizer
    )


def test_stop_string_cuts_text_and_matches_vanilla() -> None:
    vanilla, speculative = _generators()
    tokenizer = vanilla.tokenizer
    prompt = tokenizer.encode(PROMPT_TEXT)
    free = vanilla.generate(
        prompt, GenerationConfig(max_new_tokens=24, speculate=False, stop_token_ids=())
    )
    assert len(free.text) >= 8, "the tiny model must produce some text for this test"
    stop = free.text[5:7]  # a stop string the free-running output reaches
    expected_text = free.text[: free.text.find(stop)]
    for generator, speculate in ((vanilla, False), (speculative, True)):
        config = GenerationConfig(
            max_new_tokens=24, speculate=speculate, stop_strings=(stop,), stop_token_ids=()
        )
        stream = generator.stream(prompt, config)
        streamed = "".join(step.text for step in stream)
        result = stream.result
        assert result.finish_reason is FinishReason.STOP
        assert result.text == expected_text
        assert streamed == expected_text
        assert stop not in result.text


def test_stop_strings_need_a_tokenizer() -> None:
    model = make_tiny_model("llama")
    generator = SpeculativeGenerator(model)
    with pytest.raises(ValueError, match="tokenizer"):
        generator.stream([3, 4], GenerationConfig(speculate=False, stop_strings=("x",)))


def test_empty_stop_string_is_refused() -> None:
    with pytest.raises(ValueError, match="stop strings"):
        GenerationConfig(stop_strings=("",))
