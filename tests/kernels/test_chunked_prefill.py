"""A prompt prefilled in chunks (``GenerationStream.prefill(max_tokens)``) gives, on the
row-invariant kernels, the very cache, first token and output of a prefill in one forward; on
torch's ops the stream prefills the whole prompt at once instead."""

from __future__ import annotations

import pytest
import torch
from test_exact_speculation import kernel_model
from tiny_models import make_tiny_model

from selfspec.generation import GenerationConfig, GenerationStream, SpeculativeGenerator
from selfspec.heads import build_heads, heads_config_for
from selfspec.tree import DynamicTree

PROMPT = [1, 23, 5, 61, 8, 30, 44, 12, 9, 70, 3, 18, 52, 26, 11, 90, 4]


def _chunked(stream: GenerationStream, size: int) -> list[int]:
    """Prefill ``size`` tokens a call; the remaining counts seen before each call."""
    seen = []
    while stream.state is None:
        seen.append(stream.prefill_remaining)
        stream.prefill(size)
    assert stream.prefill_remaining == 0
    return seen


@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
@pytest.mark.parametrize("mode", ["float32", "int4"])
def test_chunked_prefill_is_bit_identical(kernel_path: str, mode: str, kind: str) -> None:
    model = kernel_model("llama", mode)
    generator = SpeculativeGenerator(model, build_heads(heads_config_for(model, kind)).eval())
    config = GenerationConfig(
        max_new_tokens=16, tree=DynamicTree(top_k=3, depth=3, budget=8), stop_token_ids=()
    )
    whole, chunked = generator.stream(PROMPT, config), generator.stream(PROMPT, config)
    whole.start()
    assert _chunked(chunked, 5) == [17, 12, 7, 2]
    assert chunked.state.root_token == whole.state.root_token
    for own, reference in zip(chunked.state.cache.layers, whole.state.cache.layers, strict=True):
        assert torch.equal(own.keys, reference.keys) and torch.equal(own.values, reference.values)
    while not whole.done:
        whole.step()
    while not chunked.done:
        chunked.step()
    assert chunked.result.token_ids == whole.result.token_ids
    assert chunked.result.stats.prompt_tokens == len(PROMPT)
    plain = GenerationConfig(max_new_tokens=16, speculate=False, stop_token_ids=())
    assert chunked.result.token_ids == generator.generate(PROMPT, plain).token_ids


def test_chunks_fall_back_to_one_forward_on_torch_ops() -> None:
    model = make_tiny_model("llama", seed=0)
    generator = SpeculativeGenerator(model, build_heads(heads_config_for(model, "eagle")).eval())
    assert not generator.prefill_chunks_exact
    stream = generator.stream(PROMPT, GenerationConfig(max_new_tokens=4))
    assert _chunked(stream, 5) == [len(PROMPT)]  # one call did it all


def test_a_started_stream_refuses_more_prefill(kernel_path: str) -> None:
    generator = SpeculativeGenerator(kernel_model("llama", "float32"))
    stream = generator.stream(PROMPT, GenerationConfig(max_new_tokens=4, speculate=False))
    assert stream.prefill(100) is not None
    with pytest.raises(RuntimeError, match="already started"):
        stream.prefill(4)
