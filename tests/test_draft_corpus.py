"""The draft corpus: lookups, its file (fingerprinted, refused for another base or when
malformed), its chains in context drafts, and lossless decoding with it."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest
import torch
from safetensors.torch import save_file
from tiny_models import make_lively_model, make_tiny_model

from selfspec.drafting.context import ChainSource, ContextDrafts, ContextIndex
from selfspec.drafting.corpus import CorpusError, DraftCorpus, key_ngram, load_corpus
from selfspec.fingerprint import FingerprintMismatch, fingerprint_of
from selfspec.generation import GenerationConfig, SpeculativeGenerator
from selfspec.heads import build_heads, heads_config_for
from selfspec.tree import DynamicTree


def test_the_majority_continuation_of_the_longest_ngram() -> None:
    corpus = DraftCorpus.from_sequences(
        [[1, 2, 3, 4, 5], [9, 2, 3, 4, 6], [7, 2, 3, 4, 6, 8], [1, 2, 3, 9]], vocab_size=20
    )
    assert corpus.size == 20
    # "2 3" is followed by 4 three times and 9 once; then "4" by 6 twice, 5 once.
    assert corpus.continuation([0, 2, 3], max_tokens=5) == ([4, 6, 8], 2)
    # "1 2 3" (n = 3) occurs twice: 4 then 5, and 9 (a tie: the smaller id, then the end).
    assert corpus.continuation([1, 2, 3], max_tokens=5) == ([4, 5], 3)
    assert corpus.continuation([5], max_tokens=5, min_ngram=1) == ([], 0)  # ends its response
    assert corpus.continuation([3, 11], max_tokens=5) == ([], 0)
    assert corpus.continuation([2, 3], max_tokens=1) == ([4], 2)


def test_no_continuation_crosses_a_separator() -> None:
    corpus = DraftCorpus.from_sequences([[4, 5], [6, 7]], vocab_size=10)
    assert corpus.continuation([4, 5], max_tokens=3, min_ngram=1) == ([], 0)
    assert corpus.continuation([4], max_tokens=3, min_ngram=1) == ([5], 1)


def test_keys_fit_in_int64_for_large_vocabularies() -> None:
    assert key_ngram(49_152) == 4
    assert key_ngram(151_936) == 3
    corpus = DraftCorpus.from_sequences([[150_000, 1, 2, 3, 4]], vocab_size=151_936)
    assert corpus.max_ngram == 3
    assert corpus.continuation([150_000, 1, 2], max_tokens=2) == ([3, 4], 3)


def test_bad_tokens_are_refused() -> None:
    with pytest.raises(ValueError, match="outside the vocabulary"):
        DraftCorpus.from_sequences([[1, 99]], vocab_size=50)


def test_a_saved_corpus_loads_for_its_base_only(tmp_path) -> None:
    model, other = make_tiny_model("llama", seed=0), make_tiny_model("llama", seed=1)
    corpus = DraftCorpus.from_sequences([[5, 6, 7, 8], [5, 6, 9]], vocab_size=101)
    path = corpus.save(tmp_path / "corpus.safetensors", fingerprint_of(model))
    loaded = load_corpus(path, fingerprint_of(model))
    assert np.array_equal(loaded.tokens, corpus.tokens)
    assert loaded.continuation([5, 6], 3) == corpus.continuation([5, 6], 3)
    with pytest.raises(FingerprintMismatch, match="draft corpus"):
        load_corpus(path, fingerprint_of(other))


def test_malformed_corpus_files_get_a_clear_error(tmp_path) -> None:
    fingerprint = fingerprint_of(make_tiny_model("llama"))
    garbage = tmp_path / "garbage.safetensors"
    garbage.write_bytes(b"not a safetensors file")
    with pytest.raises(CorpusError, match="cannot be read"):
        load_corpus(garbage, fingerprint)
    foreign = tmp_path / "foreign.safetensors"
    save_file({"tokens": torch.zeros(4, dtype=torch.int32)}, str(foreign))
    with pytest.raises(CorpusError, match="not a selfspec draft corpus"):
        load_corpus(foreign, fingerprint)
    broken = tmp_path / "broken.safetensors"
    metadata = {"format": "selfspec-draft-corpus", "vocab_size": "101"}
    metadata["fingerprint"] = json.dumps(fingerprint.to_dict())
    save_file({"tokens": torch.tensor([1, 500], dtype=torch.int32)}, str(broken), metadata)
    with pytest.raises(CorpusError, match="outside"):
        load_corpus(broken, fingerprint)


def test_context_drafts_add_the_corpus_chain_with_rates_of_its_own() -> None:
    corpus = DraftCorpus.from_sequences([[7, 8, 9, 10, 11]], vocab_size=20)
    index = ContextIndex(ContextDrafts(max_tokens=3), [1, 2, 3, 2, 7, 8], corpus)
    chains = index.propose()
    # "8" never occurred earlier in the request: the corpus's chain alone.
    assert [(c.source, c.tokens, c.ngram) for c in chains] == [(ChainSource.CORPUS, (9, 10, 11), 2)]
    index.observe(chains, [9, 10, 11, 4])
    assert index.rates[ChainSource.CORPUS].first[2].value == pytest.approx(2 / 3)
    assert index.rates[ChainSource.CONTEXT].first[2].value == pytest.approx(0.5)
    assert ContextIndex(ContextDrafts(corpus=False), [7, 8], corpus).propose() == ()


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_corpus_drafts_are_lossless_and_accepted_where_the_target_repeats_itself(arch) -> None:
    """The corpus holds the target's own earlier answer to the prompt: its chains are accepted
    beyond what the heads and the context give, and the output stays the vanilla output."""
    model = make_lively_model(arch)
    generator = SpeculativeGenerator(model, build_heads(heads_config_for(model, "eagle")).eval())
    prompt = [1, 23, 5, 61, 8, 30]
    config = GenerationConfig(max_new_tokens=24, stop_token_ids=(), tree=DynamicTree(3, 4, 12))
    vanilla = generator.generate(prompt, replace(config, speculate=False)).token_ids
    context_only = generator.generate(prompt, config)
    generator.corpus = DraftCorpus.from_sequences([vanilla], vocab_size=101)
    with_corpus = generator.generate(prompt, config)
    assert context_only.token_ids == vanilla and with_corpus.token_ids == vanilla
    assert with_corpus.stats.tau > context_only.stats.tau
