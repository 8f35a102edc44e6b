"""Log-probabilities of committed tokens: the target's own, identical with speculation on or
off, equal to a teacher-forced forward, one per kept token, and the prompt's when asked."""

from __future__ import annotations

import pytest
import torch
from tiny_models import save_tiny_target

from selfspec.generation import GenerationConfig, SpeculativeGenerator
from selfspec.heads import build_heads, heads_config_for
from selfspec.sampling import SamplingParams
from selfspec.target import TargetSpec, load_target
from selfspec.tree import DynamicTree

PROMPT = [1, 5, 9, 13, 2, 7, 11]


@pytest.fixture(scope="module")
def generator(tmp_path_factory: pytest.TempPathFactory) -> SpeculativeGenerator:
    path = save_tiny_target(tmp_path_factory.mktemp("logprobs") / "tiny")
    target = load_target(TargetSpec(model=str(path)))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        heads = build_heads(heads_config_for(target.model, "eagle"))
    return SpeculativeGenerator(target.model, heads, target.tokenizer)


def _teacher_forced(generator: SpeculativeGenerator, ids: list[int]) -> torch.Tensor:
    """log_softmax of the target's logits at every position of ``ids``. # [L, vocab]"""
    with torch.inference_mode():
        logits = generator.target.model(torch.tensor([ids])).logits[0]
    return torch.log_softmax(logits.float(), dim=-1)


def test_greedy_logprobs_are_identical_with_speculation_on_and_off(generator) -> None:
    config = GenerationConfig(max_new_tokens=40, logprobs=4, tree=DynamicTree(), seed=0)
    spec = generator.generate(PROMPT, config)
    vanilla = GenerationConfig(max_new_tokens=40, logprobs=4, speculate=False)
    plain = generator.generate(PROMPT, vanilla)
    assert spec.stats.tau > 1.0, "the heads never drafted: the test would not cover speculation"
    assert spec.token_ids == plain.token_ids
    assert [x.token_id for x in spec.logprobs] == spec.token_ids
    got = torch.tensor([x.logprob for x in spec.logprobs])
    want = torch.tensor([x.logprob for x in plain.logprobs])
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    for item in spec.logprobs:  # greedy: the chosen token is the best alternative
        assert len(item.top) == 4 and item.top[0][0] == item.token_id
        assert [v for _, v in item.top] == sorted((v for _, v in item.top), reverse=True)


@pytest.mark.parametrize("speculate", [True, False])
def test_sampled_tokens_carry_the_targets_log_probabilities(generator, speculate: bool) -> None:
    config = GenerationConfig(
        max_new_tokens=30,
        logprobs=2,
        sampling=SamplingParams(temperature=0.9),
        seed=3,
        speculate=speculate,
        tree=DynamicTree(),
        prompt_logprobs=True,
    )
    result = generator.generate(PROMPT, config)
    full = _teacher_forced(generator, [*PROMPT, *result.token_ids])  # [L, vocab]
    n = len(PROMPT)
    want = full[n - 1 : n - 1 + len(result.token_ids)].gather(
        -1, torch.tensor(result.token_ids)[:, None]
    )[:, 0]
    got = torch.tensor([x.logprob for x in result.logprobs])
    torch.testing.assert_close(got, want, rtol=0, atol=1e-4)
    assert result.prompt_logprobs[0] is None and len(result.prompt_logprobs) == n
    prompt_want = full[: n - 1].gather(-1, torch.tensor(PROMPT[1:])[:, None])[:, 0]
    prompt_got = torch.tensor([x.logprob for x in result.prompt_logprobs[1:]])
    torch.testing.assert_close(prompt_got, prompt_want, rtol=0, atol=1e-4)


def test_a_step_cut_by_max_new_tokens_keeps_one_logprob_per_kept_token(generator) -> None:
    for limit in (1, 2, 3, 5):
        config = GenerationConfig(max_new_tokens=limit, logprobs=0, tree=DynamicTree())
        result = generator.generate(PROMPT, config)
        assert len(result.token_ids) == len(result.logprobs) == limit
        assert all(item.top == () for item in result.logprobs)


def test_no_logprobs_unless_asked_and_bad_counts_refused(generator) -> None:
    assert generator.generate(PROMPT, GenerationConfig(max_new_tokens=3)).logprobs is None
    with pytest.raises(ValueError, match="logprobs must be None or in"):
        GenerationConfig(logprobs=21)


def test_streamed_outputs_carry_their_tokens_logprobs(generator) -> None:
    config = GenerationConfig(max_new_tokens=20, logprobs=1, tree=DynamicTree())
    stream = generator.stream(PROMPT, config)
    outputs = list(stream)
    assert all(len(o.logprobs) == len(o.token_ids) for o in outputs)
    assert [x for o in outputs for x in o.logprobs] == stream.result.logprobs


