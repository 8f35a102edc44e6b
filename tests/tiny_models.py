"""Tiny random causal LMs (and a character tokenizer) built from configs, for fast tests.

Every model: hidden 32, 2 layers, 4 attention heads (2 KV heads where the architecture has them),
vocab 101, 512 positions, eos = pad = 0, bos = 1; fp32, eval mode, weights fixed by `seed`.
"""

from __future__ import annotations

import string
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models
from transformers import (
    AutoModelForCausalLM,
    GPT2Config,
    LlamaConfig,
    MistralConfig,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerFast,
    Qwen2Config,
)

ARCHS = ("llama", "qwen2", "mistral", "gpt2")
VOCAB_SIZE = 101
EOS_ID, BOS_ID, PAD_ID = 0, 1, 0
# Minimal ChatML-like template so chat prompts can be tested without a real tokenizer.
CHAT_TEMPLATE = (
    "{% for m in messages %}<s>{{ m['role'] }}:{{ m['content'] }}</s>{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant:{% endif %}"
)

_SPECIAL_TOKENS = ("</s>", "<s>", "<unk>")  # ids 0 (eos, pad), 1 (bos), 2
_COMMON = dict(vocab_size=VOCAB_SIZE, eos_token_id=EOS_ID, bos_token_id=BOS_ID, pad_token_id=PAD_ID)
_DECODER = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
)


def tiny_config(arch: str) -> PretrainedConfig:
    """Config of the tiny model of architecture `arch` (one of `ARCHS`)."""
    if arch == "llama":
        # Tied like SmolLM2, the default target.
        return LlamaConfig(**_COMMON, **_DECODER, tie_word_embeddings=True)
    if arch == "qwen2":
        return Qwen2Config(**_COMMON, **_DECODER)
    if arch == "mistral":
        return MistralConfig(**_COMMON, **_DECODER, sliding_window=None)
    if arch == "gpt2":
        return GPT2Config(**_COMMON, n_embd=32, n_layer=2, n_head=4, n_positions=512)
    raise ValueError(f"unknown tiny architecture {arch!r}; expected one of {ARCHS}")


def make_tiny_model(arch: str, seed: int = 0) -> PreTrainedModel:
    """A tiny random causal LM of architecture `arch`; same `seed`, same weights."""
    config = tiny_config(arch)
    with torch.random.fork_rng(devices=[]):  # leave the caller's global RNG untouched
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    return model.eval()


def redraw_lively(model: PreTrainedModel, seed: int) -> PreTrainedModel:
    """Redraw every weight matrix: std 0.5 for embeddings / lm_head, 0.2 for the rest. At the
    default init (std 0.02) the tied-embedding models just repeat the last prompt token and the
    others have top-2 logit gaps of ~1e-4; redrawn, every architecture writes varied text."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() >= 2:
                big = any(part in name for part in ("embed", "wte", "wpe", "lm_head"))
                param.copy_(torch.randn(param.shape, generator=generator) * (0.5 if big else 0.2))
    return model


def make_lively_model(arch: str) -> PreTrainedModel:
    """``make_tiny_model(arch)`` redrawn lively, each architecture with its own seed."""
    return redraw_lively(make_tiny_model(arch, seed=0), seed=ARCHS.index(arch))


def make_tiny_tokenizer() -> PreTrainedTokenizerFast:
    """A character tokenizer over `VOCAB_SIZE` ids: 3 special tokens, then 98 printable chars."""
    chars = [c for c in string.printable if c not in "\x0b\x0c"]  # 98 characters
    vocab = {token: i for i, token in enumerate([*_SPECIAL_TOKENS, *chars])}
    assert len(vocab) == VOCAB_SIZE
    # BPE without merges splits text into single characters.
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    backend.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token="</s>",
        bos_token="<s>",
        pad_token="</s>",
        unk_token="<unk>",
        chat_template=CHAT_TEMPLATE,
    )


def save_tiny_target(path: Path, arch: str = "llama", seed: int = 0) -> Path:
    """Save a tiny model and the tiny tokenizer as a local HF directory `path`; return it."""
    make_tiny_model(arch, seed).save_pretrained(path)
    make_tiny_tokenizer().save_pretrained(path)
    return path


def install_block_kernels(model: PreTrainedModel, activations: str) -> None:
    """float32 mode on quantized blocks of the model's own weights, as a GGUF file gives them
    (Q4_1, the output layer Q8_0-like int8 in groups of 32), computing with ``activations``
    ("float" or "int24"); every linear layer takes its blocks (hidden 32)."""
    from selfspec.kernels.modules import install_kernels
    from selfspec.kernels.weights import quantize_int8, quantize_q4_1

    output = model.get_output_embeddings()
    given = {
        layer: quantize_int8(layer.weight, 32) if layer is output else quantize_q4_1(layer.weight)
        for layer in model.modules()
        if type(layer) is torch.nn.Linear and layer.in_features % 32 == 0
    }
    assert given, "no layer takes blocks"
    install_kernels(model, "float32", output_layer=output, given=given, activations=activations)
