"""Batched generation (selfspec.train.datagen.batch_decoder): what comes out of a request does not
depend on the batch it ran in, and equals HF's own greedy decoding."""

from __future__ import annotations

import pytest
import torch
from tiny_models import make_tiny_model

from selfspec.kernels import extension
from selfspec.kernels.modules import install_kernels
from selfspec.sampling import SamplingParams
from selfspec.train.datagen.batch_decoder import BatchDecoder, GenerationRequest
from selfspec.train.datagen.slot_cache import SlotCache


def _peaked(arch: str, seed: int = 0):
    """A tiny model with confident next-token distributions (few near-ties)."""
    model = make_tiny_model(arch, seed)
    with torch.no_grad():
        model.get_input_embeddings().weight.mul_(30.0)
        if model.get_output_embeddings().weight is not model.get_input_embeddings().weight:
            model.get_output_embeddings().weight.mul_(30.0)
    return model


def _requests(count: int, seed: int = 1) -> list[GenerationRequest]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(count):
        length = int(torch.randint(1, 24, (1,), generator=g))
        prompt = tuple(torch.randint(3, 100, (length,), generator=g).tolist())
        sampling = SamplingParams() if i % 2 else SamplingParams(temperature=0.9, top_p=0.9)
        new = int(torch.randint(1, 20, (1,), generator=g))
        out.append(GenerationRequest(str(i), prompt, new, sampling, seed=i, stop_ids=(5, 9)))
    return out


def _run(model, requests, batch_size: int, taps=(0, 1, 2)):
    decoder = BatchDecoder(
        model, batch_size=batch_size, max_prompt_tokens=24, max_new_tokens=20, tap_layers=taps
    )
    return {r.key: r for r in decoder.generate(requests)}


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
def test_kernels_make_every_request_independent_of_its_batch(arch: str) -> None:
    if extension.load() is None:
        pytest.skip("the C++ kernels are not built here")
    model = _peaked(arch)
    install_kernels(model, "float32", output_layer=model.get_output_embeddings())
    requests = _requests(30)
    alone, batched = _run(model, requests, 1), _run(model, requests, 7)
    reversed_order = _run(model, requests[::-1], 4)
    assert set(alone) == {r.key for r in requests}
    for request in requests:
        a, b, c = alone[request.key], batched[request.key], reversed_order[request.key]
        assert a.response == b.response == c.response
        assert 1 <= len(a.response) <= request.max_new_tokens
        assert a.finished == (a.response[-1] in request.stop_ids)
        fed = len(request.prompt) + len(a.response) - 1
        assert a.features.shape == (fed, 3 * 32) and a.features.dtype.name == "float16"
        assert (a.features == b.features).all() and (a.features == c.features).all()


def test_transformers_ops_give_the_same_tokens_in_any_batch() -> None:
    model = _peaked("llama")
    requests = _requests(20)
    alone, batched = _run(model, requests, 1, taps=()), _run(model, requests, 6, taps=())
    assert all(alone[k].response == batched[k].response for k in alone)
    assert all(r.features is None for r in alone.values())


def test_greedy_batched_output_equals_hf_generate() -> None:
    model = _peaked("qwen2")
    requests = [r for r in _requests(16) if r.sampling.greedy]
    results = _run(model, requests, 5, taps=())
    for request in requests:
        ids = torch.tensor([request.prompt])
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=request.max_new_tokens,
            do_sample=False,
            eos_token_id=list(request.stop_ids),
            pad_token_id=0,
        )[0, len(request.prompt) :].tolist()
        assert list(results[request.key].response) == out


def test_the_cache_compacts_and_rows_move_without_changing_results() -> None:
    if extension.load() is None:
        pytest.skip("the C++ kernels are not built here")
    model = _peaked("llama")
    install_kernels(model, "float32", output_layer=model.get_output_embeddings())
    compactions = []
    original = SlotCache.compact

    def counting(self):
        compactions.append(self.end)
        original(self)

    requests = _requests(60, seed=3)
    alone = _run(model, requests, 1, taps=())
    SlotCache.compact = counting
    try:
        batched = _run(model, requests, 8, taps=())
    finally:
        SlotCache.compact = original
    assert compactions, "60 requests of up to 43 tokens must fill a 24 + 66 column cache"
    assert all(alone[k].response == batched[k].response for k in alone)


def test_bad_requests_and_bodies_are_refused_by_name() -> None:
    model = _peaked("llama")
    decoder = BatchDecoder(model, batch_size=2, max_prompt_tokens=8, max_new_tokens=4)
    long_prompt = GenerationRequest("long", tuple(range(3, 12)), 2)
    with pytest.raises(ValueError, match="request long: prompt of 9 tokens"):
        list(decoder.generate([long_prompt]))
    with pytest.raises(ValueError, match="request many: max_new_tokens 5"):
        list(decoder.generate([GenerationRequest("many", (3, 4), 5)]))
    with pytest.raises(ValueError, match="Llama-family body"):
        BatchDecoder(make_tiny_model("gpt2"))
    with pytest.raises(ValueError, match="batch_size"):
        BatchDecoder(model, batch_size=0)
