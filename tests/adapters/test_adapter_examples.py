"""The shipped example adapters on the real default target (marked real_model, kept short)."""

from __future__ import annotations

import pytest

from selfspec import GenerationConfig, SpeculativeGenerator, apply_chat_template
from selfspec.adapters.shipped import EXAMPLES_DIR, examples_root
from selfspec.adapters.store import AdapterStore
from selfspec.adapters.validate import WEIGHTS_FILE

EXAMPLES = ("code", "docs", "persona", "shout")
pytestmark = pytest.mark.real_model


@pytest.fixture(scope="module")
def target():
    from selfspec.target import TargetSpec, load_target

    if examples_root() is None:
        pytest.skip(f"no example adapters under {EXAMPLES_DIR}")
    return load_target(TargetSpec(threads=1))


def _heads(model):
    """The shipped EAGLE heads when present, else untrained Medusa heads (equality holds anyway)."""
    from selfspec import build_heads, heads_config_for, load_heads
    from selfspec.shipped import shipped_heads_dir

    try:
        return load_heads(shipped_heads_dir("eagle"), model)
    except FileNotFoundError:
        return build_heads(heads_config_for(model, "medusa")).eval()


def test_examples_are_valid_small_and_lossless(target) -> None:
    store = AdapterStore(target.model, root=EXAMPLES_DIR)
    assert set(EXAMPLES) <= set(store.names()), store.rejected
    generator = SpeculativeGenerator(target.model, _heads(target.model), target.tokenizer)
    prompt = apply_chat_template(target.tokenizer, "How do I make a cup of tea?")
    speculative = GenerationConfig(max_new_tokens=24)
    vanilla = GenerationConfig(max_new_tokens=24, speculate=False)
    base = generator.generate(prompt, vanilla, scope=store.scope(None)).token_ids
    for name in EXAMPLES:
        assert (EXAMPLES_DIR / name / WEIGHTS_FILE).stat().st_size < 3 * 2**20
        scope = store.scope(name)
        expected = generator.generate(prompt, vanilla, scope=scope).token_ids
        assert generator.generate(prompt, speculative, scope=scope).token_ids == expected, name
        assert expected != base, f"{name} does not change the base's answer"
