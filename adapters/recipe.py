"""Recipe of the example adapters: LoRA fine-tunes of the default target, a few CPU minutes each.

    python -m selfspec.adapters.recipe --out adapters/examples [--only code docs persona shout]

For each adapter (data: see `recipe_data.py`): LoRA r=8, alpha=16 on q/v/o/down projections of
every layer, AdamW, linear decay, loss on the response tokens only, fp32 training, weights stored
in bfloat16 (< 3 MB). Beside the peft files, `selfspec_adapter.json` records the base fingerprint
(the store refuses another base), this recipe, and how far the adapter moves the base: top-1
agreement with the base on held-out text (the base's own greedy answers to held-out prompts,
teacher-forced). Each directory is written atomically.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from selfspec.adapters.recipe_data import (
    PERSONA_SYSTEM,
    ChatExample,
    code_examples,
    docs_examples,
    package_examples,
    read_prompts,
    shout,
)
from selfspec.adapters.validate import META_FILE, WEIGHTS_FILE
from selfspec.atomic import replace_dir, staging_dir_for
from selfspec.fingerprint import fingerprint_of
from selfspec.target import TargetSpec, load_target

ADAPTERS = ("code", "docs", "persona", "shout")
HELDOUT_ADAPTERS = ("terse", "bullets", "licences")
"""Never shipped, never used for the heads: the robustness evaluation's held-out shifts."""
PROMPTS = Path(__file__).resolve().parents[1] / "train" / "data"
IGNORE = -100
RECIPE = "selfspec.adapters.recipe"


@dataclass(frozen=True)
class RecipeConfig:
    """Hyper-parameters shared by the example adapters."""

    rank: int = 8
    alpha: int = 16
    targets: tuple[str, ...] = (
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"
    )
    layers: tuple[int, ...] = tuple(range(18, 30))
    """Only the top 12 of the 30 layers: backward stops there (CPU minutes) and the file stays
    under 3 MB."""
    examples: int = 128
    """Training pairs per adapter."""
    steps: int = 40
    batch_size: int = 4
    max_len: int = 128
    """Tokens per training sequence (prompt + response), truncated beyond."""
    lr: float = 3e-3
    seed: int = 0
    gen_batch: int = 16
    gen_tokens: int = 64
    """Most tokens of each distilled answer (persona, shout, held-out)."""
    heldout: int = 16
    """Held-out prompts whose base answers measure top-1 agreement."""


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m selfspec.adapters.recipe", description=__doc__)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "examples")
    parser.add_argument(
        "--only", nargs="*", choices=ADAPTERS + HELDOUT_ADAPTERS, default=list(ADAPTERS)
    )
    cache = Path(tempfile.gettempdir()) / "selfspec-recipe"
    parser.add_argument("--cache", type=Path, default=cache, help="distilled answers kept here")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--steps", type=int, default=RecipeConfig.steps)
    args = parser.parse_args(argv)
    config = RecipeConfig(steps=args.steps)
    target = load_target(TargetSpec(threads=args.threads))
    model, tokenizer = target.model, target.tokenizer
    args.cache.mkdir(parents=True, exist_ok=True)
    heldout_prompts = read_prompts(PROMPTS / "prompts_heldout.jsonl", config.heldout, config.seed)
    heldout_cache = args.cache / "heldout.jsonl"
    heldout = _answers(model, tokenizer, heldout_prompts, None, config, heldout_cache)
    heldout = heldout[: config.heldout]
    heldout_batch = _encode(tokenizer, heldout, config.max_len)
    base_top1 = _top1(model, heldout_batch)
    for name in args.only:
        started = time.time()
        examples = _examples(name, model, tokenizer, config, args.cache)
        metrics = _finetune_and_save(
            model, tokenizer, name, examples, config, args.out, base_top1, heldout_batch
        )
        seconds = round(time.time() - started)
        print(json.dumps({"adapter": name, "seconds": seconds, **metrics}), flush=True)
    return 0


def _examples(name: str, model, tokenizer, config: RecipeConfig, cache: Path) -> list[ChatExample]:
    if name == "code":
        return code_examples(config.examples, config.seed)
    if name == "docs":
        return docs_examples(config.examples, config.seed)
    if name in HELDOUT_ADAPTERS:
        return package_examples(name, config.examples, config.seed)
    prompts = read_prompts(PROMPTS / "prompts.jsonl", config.examples, config.seed + 1)
    if name == "persona":
        persona_cache = cache / "persona.jsonl"
        answers = _answers(model, tokenizer, prompts, PERSONA_SYSTEM, config, persona_cache)
        return [ChatExample(e.prompt, e.response) for e in answers]  # trained without the system
    plain = _answers(model, tokenizer, prompts, None, config, cache / "plain.jsonl")
    return [ChatExample(e.prompt, shout(e.response)) for e in plain]


@torch.inference_mode()
def _answers(model, tokenizer, prompts, system, config: RecipeConfig, cache: Path):
    """The base's greedy answers (cached as JSONL: generating is the slow part)."""
    if cache.is_file():
        return [ChatExample(**json.loads(line)) for line in cache.read_text().splitlines()]
    tokenizer.padding_side = "left"
    out = []
    for start in range(0, len(prompts), config.gen_batch):
        chunk = prompts[start : start + config.gen_batch]
        texts = [
            tokenizer.apply_chat_template(
                _messages(ChatExample(p, "", system))[:-1],
                tokenize=False,
                add_generation_prompt=True,
            )
            for p in chunk
        ]
        batch = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        generated = model.generate(
            **batch, max_new_tokens=config.gen_tokens, do_sample=False,
            pad_token_id=tokenizer.pad_token_id,
        )[:, batch["input_ids"].shape[1] :]  # [B, new]
        for prompt, ids in zip(chunk, generated, strict=True):
            out.append(ChatExample(prompt, tokenizer.decode(ids, skip_special_tokens=True).strip()))
        print(f"generated {len(out)}/{len(prompts)} answers for {cache.name}", flush=True)
    tokenizer.padding_side = "right"
    cache.write_text("".join(json.dumps(asdict(e)) + "\n" for e in out))
    return out


def _messages(example: ChatExample) -> list[dict[str, str]]:
    system = [{"role": "system", "content": example.system}] if example.system else []
    return [*system, {"role": "user", "content": example.prompt},
            {"role": "assistant", "content": example.response}]


def _encode(tokenizer, examples: Sequence[ChatExample], max_len: int) -> dict[str, torch.Tensor]:
    """Right-padded batch with labels on the response tokens only. # each [N, L]"""
    rows, labels = [], []
    for example in examples:
        messages = _messages(example)
        full = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True)
        prompt = tokenizer.apply_chat_template(
            messages[:-1], tokenize=True, return_dict=True, add_generation_prompt=True
        )
        ids, cut = list(full["input_ids"])[:max_len], len(prompt["input_ids"])
        rows.append(ids)
        labels.append([IGNORE] * min(cut, len(ids)) + ids[cut:])
    width = max(len(r) for r in rows)
    pad = tokenizer.pad_token_id
    return {
        "input_ids": torch.tensor([r + [pad] * (width - len(r)) for r in rows]),
        "attention_mask": torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows]),
        "labels": torch.tensor([r + [IGNORE] * (width - len(r)) for r in labels]),
    }


@torch.inference_mode()
def _top1(model, batch: dict[str, torch.Tensor], chunk: int = 4) -> torch.Tensor:
    """Argmax next-token predictions at every labelled position. # [positions]"""
    predictions = []
    for start in range(0, batch["input_ids"].shape[0], chunk):
        part = {k: v[start : start + chunk] for k, v in batch.items()}
        logits = model(input_ids=part["input_ids"], attention_mask=part["attention_mask"]).logits
        scored = part["labels"][:, 1:] != IGNORE  # [b, L-1]: positions predicting a response token
        predictions.append(logits[:, :-1].argmax(-1)[scored])
    return torch.cat(predictions)


def _finetune_and_save(model, tokenizer, name, examples, config, out_dir, base_top1, heldout):
    from peft import LoraConfig, get_peft_model
    from peft.utils import get_peft_model_state_dict

    torch.manual_seed(config.seed)
    fingerprint = fingerprint_of(model)
    lora = LoraConfig(r=config.rank, lora_alpha=config.alpha, lora_dropout=0.0,
                      target_modules=list(config.targets), layers_to_transform=list(config.layers),
                      task_type="CAUSAL_LM")
    peft_model = get_peft_model(model, lora)
    data = _encode(tokenizer, examples, config.max_len)
    params = [p for p in peft_model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=config.lr, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1 - s / config.steps)
    order = torch.randperm(len(examples), generator=torch.Generator().manual_seed(config.seed))
    peft_model.train()
    losses = []
    started = time.time()
    for step in range(config.steps):
        first = step * config.batch_size
        picks = torch.stack([order[(first + i) % len(order)] for i in range(config.batch_size)])
        batch = {k: v[picks] for k, v in data.items()}
        width = int(batch["attention_mask"].sum(1).max())
        batch = {k: v[:, :width] for k, v in batch.items()}
        loss = peft_model(**batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
        if step % 5 == 0 or step == config.steps - 1:
            print(f"{name} step {step} loss {loss:.3f} ({time.time() - started:.0f} s)", flush=True)
    peft_model.eval()
    agreement = float((_top1(peft_model, heldout) == base_top1).float().mean())
    state = {k: v.detach().to(torch.bfloat16).contiguous()
             for k, v in get_peft_model_state_dict(peft_model).items()}
    metrics = {
        "first_loss": round(sum(losses[:5]) / len(losses[:5]), 4),
        "final_loss": round(sum(losses[-5:]) / len(losses[-5:]), 4),
        "top1_agreement_with_base": round(agreement, 4),
    }
    meta = {
        "base": fingerprint.to_dict(),
        "recipe": {"name": name, "module": RECIPE, **asdict(config), "examples": len(examples)},
        "metrics": metrics,
    }
    _write_adapter(out_dir / name, peft_model.peft_config["default"], state, meta)
    peft_model.unload()  # removes the LoRA layers: the base is as before for the next adapter
    return metrics


def _write_adapter(path: Path, lora, state: dict[str, torch.Tensor], meta: dict) -> None:
    """Write config + weights + meta under a temporary name, then rename into place."""
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = staging_dir_for(path)
    try:
        lora.base_model_name_or_path = "SmolLM2-135M-Instruct"
        lora.inference_mode = True
        lora.save_pretrained(str(staging))
        save_file(state, str(staging / WEIGHTS_FILE), metadata={"format": "pt"})
        (staging / META_FILE).write_text(json.dumps(meta, indent=2) + "\n")
        replace_dir(staging, path)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


if __name__ == "__main__":
    raise SystemExit(main())
