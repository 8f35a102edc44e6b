"""Test adapters for the server tests; the background server runner lives in selfspec.serve."""

from __future__ import annotations

from pathlib import Path

import torch
from peft import LoraConfig, get_peft_model
from tiny_models import make_tiny_model

from selfspec.serve.background import free_port, running_server

__all__ = ["free_port", "make_adapter", "running_server"]


def make_adapter(path: Path, seed: int, targets: tuple[str, ...] = ("q_proj", "v_proj")) -> Path:
    """A LoRA adapter of the tiny Llama with random non-zero weights (moves the output)."""
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=list(targets))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = get_peft_model(make_tiny_model("llama", 0), lora)
        for name, param in model.named_parameters():
            if "lora_" in name:
                torch.nn.init.normal_(param, std=0.5)
    model.save_pretrained(path, safe_serialization=True)
    return path
