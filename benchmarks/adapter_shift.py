"""Why shared heads draft worse under an adapter: the shifted text, or the shifted features?

For each adapter (and the base), the adapted target answers held-out prompts greedily; then the
shared heads predict each response token teacher-forced (EAGLE: the token two ahead of the
feature, from the feature at t and the token at t+1, as in drafting at depth 1), reading either
the **adapted** target's features (what serving gives them) or the **base**'s features over the
same text. Reported against the adapted target's own tokens:

- ``text = base``: the share of the adapted responses' tokens the base would also choose there
  (teacher-forced argmax): how far the adapter moved the text;
- ``top-1, adapted features``: the heads' depth-1 agreement as served;
- ``top-1, base features``: the same heads on the same text with the base's features. If this
  is no better, the loss comes from the text the heads never learnt to continue (training needs
  adapter-like text); if much better, from the features (training under perturbed targets on
  the same text would help);
- both split by whether the token is among the base responses' frequent tokens (the heads' draft
  vocabulary) and whether the base itself would have chosen it.

    .venv/bin/python benchmarks/adapter_shift.py --adapters-root runs/heldout-adapters \
        --adapters terse bullets licences --out runs/adapter_shift
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from tqdm import tqdm

from selfspec.adapters.store import AdapterStore
from selfspec.atomic import write_text_atomic
from selfspec.cost_curve import cpu_flags, cpu_model
from selfspec.drafting.taps import maybe_capture
from selfspec.generation import GenerationConfig, SpeculativeGenerator
from selfspec.heads import load_heads
from selfspec.heads.eagle import EagleCache
from selfspec.shipped import resolve_heads_dir
from selfspec.target import TargetSpec, apply_chat_template, load_target

HELDOUT = Path(__file__).resolve().parents[1] / "train" / "data" / "prompts_heldout.jsonl"


@torch.inference_mode()
def teacher_forced(generator: SpeculativeGenerator, ids: list[int]):
    """The target over ``ids`` in one causal forward: what the heads read (the last hidden
    state, or EAGLE-3's tapped layers) # [L, F], and the last hidden state # [L, H]."""
    target = generator.target
    tokens = torch.tensor([ids], device=target.device)
    positions = torch.arange(len(ids), device=target.device)[None]
    with maybe_capture(generator.taps) as tapped:
        last = target.features(tokens, positions, target.new_cache())[0]
    return (last if tapped is None else tapped.stacked()[0]), last


@torch.inference_mode()
def head_predictions(generator: SpeculativeGenerator, ids: list[int], features) -> torch.Tensor:
    """The heads' depth-1 guess for token t+2 from (feature_t, token_{t+1}), every t # [L-2]"""
    drafter = generator.drafter
    tokens = torch.tensor(ids[1:], device=features.device)  # token_{t+1}
    positions = torch.arange(1, len(ids), device=features.device)[None]
    out = drafter.head(
        generator.target.embed(tokens)[None],
        drafter.head_features(features)[None, :-1],
        positions,
        None,
        EagleCache(),
    )[0]  # [L-1, H]: the predicted feature at t+1
    logits = drafter.projection.logits(out[:-1])  # [L-2, N]
    return drafter.projection.token_ids(logits.argmax(-1))


def _count(counts: dict, key: str, hits: torch.Tensor, where: torch.Tensor) -> None:
    total = counts.setdefault(key, [0, 0])
    total[0] += int(hits[where].sum())
    total[1] += int(where.sum())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--adapters-root", type=Path, required=True)
    parser.add_argument("--adapters", nargs="+", required=True)
    parser.add_argument("--heads", default="eagle", help="'eagle' or an EAGLE / EAGLE-3 dir")
    parser.add_argument("--prompts", type=Path, default=HELDOUT)
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=Path("runs/adapter_shift"))
    args = parser.parse_args()

    target = load_target(TargetSpec(threads=args.threads))
    heads = load_heads(resolve_heads_dir(args.heads, True), target.model)
    store = AdapterStore(target.model, root=args.adapters_root)
    generator = SpeculativeGenerator(target.model, heads, target.tokenizer)
    if not hasattr(generator.drafter, "head_features"):
        parser.error("EAGLE or EAGLE-3 heads only (Medusa heads draft every depth at once)")
    draft_vocab = generator.drafter.projection.draft_vocab  # [N] or None: the whole vocabulary
    vocab = set(
        range(target.model.config.vocab_size) if draft_vocab is None else draft_vocab.tolist()
    )
    rows = [json.loads(line) for line in args.prompts.read_text().splitlines() if line.strip()]
    prompts = [apply_chat_template(target.tokenizer, r["prompt"]) for r in rows[: args.num_prompts]]
    config = GenerationConfig(max_new_tokens=args.max_new_tokens, speculate=False)

    results = []
    for name in tqdm([None, *args.adapters], desc="targets"):
        counts: dict[str, list[int]] = {}  # key -> [hits, tokens]

        for prompt in prompts:
            with store.scope(name)():
                response = generator.generate(prompt, config).token_ids
            ids = prompt + response
            with store.scope(name)():
                adapted, _ = teacher_forced(generator, ids)  # [L, F]
                on_adapted = head_predictions(generator, ids, adapted)
            with store.scope(None)():
                base, last = teacher_forced(generator, ids)
                on_base = head_predictions(generator, ids, base)
                base_choice = generator.target.logits(last).argmax(-1)  # [L]: its next token
            # Token i (i >= len(prompt) + 1) as drafted at depth 1: predicted at t = i - 2.
            first = len(prompt) + 1
            labels = torch.tensor(ids[first:])
            adapted_hits = on_adapted[first - 2 :].cpu() == labels
            base_hits = on_base[first - 2 :].cpu() == labels
            text_is_base = base_choice[first - 1 : -1].cpu() == labels
            in_vocab = torch.tensor([t in vocab for t in ids[first:]])
            every = torch.ones_like(labels, dtype=torch.bool)
            _count(counts, "text = base", text_is_base, every)
            for key, hits in (("adapted", adapted_hits), ("base", base_hits)):
                _count(counts, f"top-1, {key} features", hits, every)
                _count(counts, f"top-1, {key} features, base's own token", hits, text_is_base)
                _count(counts, f"top-1, {key} features, other token", hits, ~text_is_base)
                _count(counts, f"top-1, {key} features, outside draft vocab", hits, ~in_vocab)
        results.append(
            {
                "target": name or "base",
                "tokens": counts["text = base"][1],
                **{k: round(h / max(n, 1), 3) for k, (h, n) in counts.items()},
                "other tokens": counts["top-1, adapted features, other token"][1],
                "outside draft vocab": counts["top-1, adapted features, outside draft vocab"][1],
            }
        )
    print(f"{cpu_model()}; flags {' '.join(cpu_flags())}; float32, {args.threads} thread(s)")
    keys = [k for k in results[0] if k != "target"]
    print("| target | " + " | ".join(keys) + " |")
    print("|---|" + "---:|" * len(keys))
    for r in results:
        print(f"| {r['target']} | " + " | ".join(str(r[k]) for k in keys) + " |")
    args.out.mkdir(parents=True, exist_ok=True)
    record = {
        "cpu": cpu_model(),
        "flags": cpu_flags(),
        "args": {k: str(v) for k, v in vars(args).items()},
    }
    write_text_atomic(
        args.out / "adapter_shift.json", json.dumps({**record, "rows": results}, indent=1)
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
