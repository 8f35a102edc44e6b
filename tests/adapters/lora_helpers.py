"""Make real peft LoRA adapters for the tiny test models, and a plain greedy reference."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch
from peft import LoraConfig, get_peft_model
from tiny_models import make_tiny_model

DEFAULT_TARGETS = ("q_proj", "v_proj")


def make_adapter(
    path: Path,
    seed: int,
    targets: Sequence[str] = DEFAULT_TARGETS,
    rank: int = 4,
    arch: str = "llama",
    base_seed: int = 0,
    std: float = 0.5,
    **config: object,
) -> Path:
    """Save a LoRA adapter for the tiny `arch` model with random (non-zero) A and B weights."""
    base = make_tiny_model(arch, base_seed)
    lora = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=list(targets), **config)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = get_peft_model(base, lora)
        for name, param in model.named_parameters():
            if "lora_" in name:
                torch.nn.init.normal_(param, std=std)
    model.save_pretrained(path, safe_serialization=True)
    return path


@torch.inference_mode()
def greedy_reference(model: torch.nn.Module, prompt: Sequence[int], new_tokens: int) -> list[int]:
    """Greedy decoding by full recomputation, no cache: the plainest possible reference."""
    ids = list(prompt)
    out: list[int] = []
    for _ in range(new_tokens):
        logits = model(input_ids=torch.tensor([ids])).logits[0, -1]
        token = int(logits.argmax())
        out.append(token)
        ids.append(token)
        if token == 0:  # the tiny models' eos
            break
    return out


def reference_under(adapter_dir: Path | None, prompt: Sequence[int], new_tokens: int) -> list[int]:
    """Greedy output of a fresh tiny Llama with the adapter loaded by peft's own loader."""
    from peft import PeftModel

    model = make_tiny_model("llama", 0)
    if adapter_dir is not None:
        model = PeftModel.from_pretrained(model, adapter_dir).eval()
    return greedy_reference(model, prompt, new_tokens)
