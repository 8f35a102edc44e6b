"""Every tensor the decoding loop creates names its device: a CPU-only assumption caught on a CPU.

On a GPU, a tensor made without ``device=`` lands on the CPU and meets the model's CUDA tensors
in the next op (an error, or a silent host copy per step). Such bugs do not show on a CPU, where
every default device is right, so this test watches the factory calls themselves: it runs the
loop's paths (vanilla, EAGLE / EAGLE-3 / Medusa drafts, greedy and sampled verification, a draft
vocabulary, adaptive sizing, log-probabilities, a prefix cache, batched verification, the LoRA
bank) under a ``TorchFunctionMode`` that records each ``torch.zeros`` / ``tensor`` / ``arange``
... called from selfspec's own files without a ``device`` argument. A tensor deliberately built on
the host (a small mask filled element by element, then copied once) says ``device="cpu"``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from batched_streams import run_batched
from tiny_models import make_tiny_model
from torch.overrides import TorchFunctionMode

import selfspec
from selfspec.cost_curve import CostCurve
from selfspec.generation import GenerationConfig, SpeculativeGenerator
from selfspec.heads import build_heads, heads_config_for
from selfspec.heads.draft_vocab import with_draft_vocab
from selfspec.prefix_cache import PrefixCache
from selfspec.sampling import SamplingParams
from selfspec.tree import DraftSampling, DynamicTree, StaticTree

FACTORIES = {
    torch.tensor,
    torch.as_tensor,
    torch.arange,
    torch.zeros,
    torch.ones,
    torch.full,
    torch.empty,
    torch.eye,
    torch.rand,
    torch.randn,
    torch.randint,
    torch.randperm,
}
# selfspec's own code: the core and the wings (installed editable, they live at the repo root).
ROOT = Path(selfspec.__file__).resolve().parents[1]
OWN = tuple(str(ROOT / part) + "/" for part in ("selfspec", "adapters", "serve"))
PROMPT = [1, 23, 5, 61, 8, 30]
SAMPLED = SamplingParams(temperature=0.8, top_k=40)
FLAT = CostCurve(sizes=(1, 64), seconds=(0.01, 0.012))


class FactoryWatch(TorchFunctionMode):
    """Records ``file:line`` of every factory call from selfspec's files without ``device=``."""

    def __init__(self) -> None:
        super().__init__()
        self.undeviced: set[str] = set()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in FACTORIES and "device" not in kwargs:
            caller = sys._getframe(1)
            if caller.f_code.co_filename.startswith(OWN):
                where = Path(caller.f_code.co_filename).relative_to(ROOT)
                self.undeviced.add(f"{where}:{caller.f_lineno} torch.{func.__name__}")
        return func(*args, **kwargs)


def _model(arch: str = "llama") -> torch.nn.Module:
    model = make_tiny_model(arch, seed=0)
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():  # redrawn larger, so drafts get accepted and every path runs
        for name, param in model.named_parameters():
            if param.dim() >= 2:
                scale = 0.5 if any(p in name for p in ("embed", "wte", "lm_head")) else 0.2
                param.copy_(torch.randn(param.shape, generator=generator) * scale)
    return model


def _heads(model: torch.nn.Module, kind: str) -> torch.nn.Module:
    return build_heads(heads_config_for(model, kind)).eval()


def _config(**kwargs: object) -> GenerationConfig:
    return GenerationConfig(max_new_tokens=12, stop_token_ids=(), **kwargs)


def _run_everything() -> FactoryWatch:
    model = _model()
    # The heads are built before the watch starts: module constructors make their weights on
    # the CPU, and load_heads / with_draft_vocab move them to the target's device.
    eagle = SpeculativeGenerator(model, _heads(model, "eagle"), cost_curve=FLAT)
    medusa = SpeculativeGenerator(model, _heads(model, "medusa"))
    small_vocab = with_draft_vocab(_heads(model, "eagle"), torch.arange(2, 60))
    narrow = SpeculativeGenerator(model, small_vocab)
    eagle3 = SpeculativeGenerator(model, _heads(model, "eagle3"))
    dynamic = DynamicTree(top_k=3, depth=3, budget=8)
    watch = FactoryWatch()
    with watch:
        eagle.generate(PROMPT, _config(speculate=False, logprobs=2, prompt_logprobs=True))
        eagle.generate(PROMPT, _config(tree=dynamic, logprobs=1))
        eagle.generate(PROMPT, _config())  # adaptive: sized on the cost curve
        for tree in (dynamic, StaticTree.chain(3)):
            eagle.generate(
                PROMPT,
                _config(
                    tree=tree,
                    sampling=SAMPLED,
                    seed=1,
                    draft_sampling=DraftSampling.WITHOUT_REPLACEMENT,
                ),
            )
        medusa.generate(PROMPT, _config(tree=StaticTree.full((2, 2)), sampling=SAMPLED, seed=2))
        narrow.generate(PROMPT, _config(tree=dynamic))
        eagle3.generate(PROMPT, _config(tree=dynamic, sampling=SAMPLED, seed=3))
        # Prefix reuse: the second request copies the first one's cached prompt entries.
        eagle.prefix_cache = PrefixCache()
        for _ in range(2):
            eagle.generate(PROMPT + [40, 41], _config(tree=dynamic, prefix_namespace="base"))
        eagle.prefix_cache = None
        # Two requests verified in one forward.
        streams = [
            eagle.stream(PROMPT, _config(tree=dynamic)),
            eagle.stream(PROMPT[:3], _config(speculate=False)),
        ]
        run_batched(streams)
    return watch


def test_the_decoding_loop_names_the_device_of_every_tensor_it_makes() -> None:
    watch = _run_everything()
    assert not watch.undeviced, "tensors made without device=: " + ", ".join(
        sorted(watch.undeviced)
    )


def test_the_lora_bank_names_the_device_of_every_tensor_it_makes() -> None:
    pytest.importorskip("peft")
    from selfspec.adapters import fast_lora

    model = _model()
    bank = fast_lora.LoraBank(model)
    hidden = model.config.hidden_size
    generator = torch.Generator().manual_seed(5)
    weights = {
        f"model.layers.{i}.self_attn.q_proj": fast_lora.LoraWeights(
            torch.randn(4, hidden, generator=generator),
            torch.randn(hidden, 4, generator=generator),
            0.5,
        )
        for i in range(2)
    }
    watch = FactoryWatch()
    with watch:
        bank.add("a", weights)
        bank.add("b", weights)
        generator_ = SpeculativeGenerator(model)
        bank.select("a")
        generator_.generate(PROMPT, _config(speculate=False))
        bank.select_rows(["a", None])
        with torch.inference_mode():
            model(torch.tensor([PROMPT, PROMPT], device="cpu"))
    bank.close()
    assert not watch.undeviced, "tensors made without device=: " + ", ".join(
        sorted(watch.undeviced)
    )


def test_the_watch_sees_a_tensor_made_without_a_device(tmp_path: Path) -> None:
    """The watch itself: a factory call from selfspec's files without ``device=`` is caught."""
    from selfspec import tree as tree_module

    watch = FactoryWatch()
    with watch:
        tree_module.torch.zeros(1)  # from this test's file: not selfspec's, not recorded
        assert not watch.undeviced
        exec(compile("torch.zeros(2)", tree_module.__file__, "exec"), {"torch": torch})
    assert watch.undeviced == {"selfspec/tree.py:1 torch.zeros"}
