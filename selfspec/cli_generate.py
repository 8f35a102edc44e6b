"""``selfspec generate``: one prompt through the target, speculating with draft heads."""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field

from selfspec.cli_args import parse_dataclass
from selfspec.draft_options import DraftOptions
from selfspec.sampling import SamplingParams
from selfspec.target_options import TargetOptions
from selfspec.tree import DraftSampling, parse_tree_spec

PROG = "selfspec generate"


@dataclass(frozen=True)
class GenerateArgs(DraftOptions, TargetOptions):
    """The target's options (`TargetOptions`: model, dtype, kernels, device, threads), the
    drafting ones (`DraftOptions`: context drafts, draft corpus), then these."""

    prompt: str = field(metadata={"help": "the user prompt"})
    heads: str = field(
        default="eagle",
        metadata={
            "help": "heads dir, or 'eagle' / 'medusa' for the heads shipped for the default model"
        },
    )
    chat: bool = field(
        default=True, metadata={"help": "wrap the prompt in the model's chat template"}
    )
    max_new_tokens: int = field(default=128, metadata={"help": "most tokens to generate"})
    temperature: float = field(default=0.0, metadata={"help": "0 = greedy"})
    top_k: int = field(default=0, metadata={"help": "sample among the k likeliest; 0 = all"})
    top_p: float = field(default=1.0, metadata={"help": "nucleus sampling mass"})
    seed: int | None = field(default=None, metadata={"help": "seed of the request's generator"})
    tree: str = field(
        default="auto",
        metadata={
            "help": "auto (adaptive) | adaptive[:TOP_K,DEPTH,MAX_BUDGET] | static | chain:D | "
            "dynamic[:TOP_K,DEPTH,BUDGET] | paths.json"
        },
    )
    draft_sampling: DraftSampling = field(
        default=DraftSampling.WITHOUT_REPLACEMENT,
        metadata={
            "help": "how children are drawn when sampling: without_replacement (sampled from "
            "the heads) | top_k (their k likeliest, EAGLE-2)"
        },
    )
    speculation: bool = field(default=True, metadata={"help": "--no-speculation: vanilla baseline"})
    speculation_gate: bool = field(
        default=True,
        metadata={
            "help": "an adaptive tree's steps draft only while drafting commits more tokens per "
            "second than plain decoding; --no-speculation-gate: draft at every step"
        },
    )
    stop: tuple[str, ...] = field(default=(), metadata={"help": "stop strings"})
    json: bool = field(
        default=False, metadata={"help": "print text, token ids and stats as one JSON object"}
    )
    adapter: str | None = field(
        default=None,
        metadata={
            "help": "LoRA adapter: a directory, or a name under --adapters-root "
            "(default: the shipped examples); omit for the base model"
        },
    )
    adapters_root: str | None = field(
        default=None, metadata={"help": "directory of adapter directories that --adapter names"}
    )
    adapter_heads: bool = field(
        default=True,
        metadata={
            "help": "an adapter carrying recalibrated heads (<adapter>/heads/) speculates with "
            "them; off: --heads"
        },
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        object.__setattr__(self, "draft_sampling", DraftSampling(self.draft_sampling))
        SamplingParams(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p)
        parse_tree_spec(self.tree)
        if self.max_new_tokens < 1:
            raise ValueError(f"--max-new-tokens must be >= 1, got {self.max_new_tokens}")


def resolve_heads(
    args: GenerateArgs, target_model: object, is_default_target: bool
) -> object | None:
    """The heads module to speculate with, or None for --no-speculation."""
    from selfspec.heads import load_heads
    from selfspec.shipped import resolve_heads_dir

    if not args.speculation:
        return None
    return load_heads(resolve_heads_dir(args.heads, is_default_target), target_model)


def main(argv: Sequence[str]) -> int:
    args = parse_dataclass(GenerateArgs, argv, description=__doc__, prog=PROG)
    from selfspec.cost_curve import machine_cost_curve, needs_cost_curve
    from selfspec.generation import GenerationConfig, SpeculativeGenerator
    from selfspec.target import apply_chat_template, load_target

    try:
        target = load_target(args.target_spec())
        heads = resolve_heads(args, target.model, args.is_default_target)
        tokenizer = target.tokenizer
        prompt_ids = (
            apply_chat_template(tokenizer, args.prompt)
            if args.chat
            else tokenizer.encode(args.prompt)
        )
        config = GenerationConfig(
            max_new_tokens=args.max_new_tokens,
            sampling=SamplingParams(
                temperature=args.temperature, top_k=args.top_k, top_p=args.top_p
            ),
            seed=args.seed,
            stop_strings=args.stop,
            speculate=args.speculation,
            tree=parse_tree_spec(args.tree),
            draft_sampling=args.draft_sampling,
            context_drafts=args.context_drafts_config(),
        )
        scope = None
        if args.adapter is not None:
            # Lazy: the adapters wing (and peft) is imported only when an adapter is asked for.
            # Its errors are ValueErrors, reported below like any other bad input.
            from selfspec.adapters.select import select_adapter

            store, name, scope = select_adapter(
                target.model, args.adapter, args.adapters_root, args.is_default_target
            )
            own_heads = store.info(name).heads_path
            if heads is not None and args.adapter_heads and own_heads is not None:
                from selfspec.heads import load_heads

                heads = load_heads(own_heads, target.model)
                print(f"{PROG}: speculating with {name}'s own heads ({own_heads})", file=sys.stderr)
        # Adaptive trees (the default) size each step from this machine's measured cost curve:
        # measured once (a few seconds), then read from the cache.
        curve = (
            machine_cost_curve(target.model)
            if heads is not None and needs_cost_curve(config.tree)
            else None
        )
        generator = SpeculativeGenerator(target.model, heads, tokenizer, curve)
        if heads is not None:
            generator.corpus = args.corpus_for(target.model, args.is_default_target)
        if not args.speculation_gate:
            generator.gate = None
        stream = generator.stream(prompt_ids, config, scope)
    # TargetLoadError, HeadsCheckpointError, FingerprintMismatch and AdapterError are ValueErrors.
    except (FileNotFoundError, ValueError) as error:
        print(f"{PROG}: error: {error}", file=sys.stderr)
        return 2
    for step in stream:
        if not args.json:
            print(step.text, end="", flush=True)
    result = stream.result
    if args.json:
        print(json.dumps({"model": target.name, "adapter": args.adapter, **result.to_dict()}))
        return 0
    stats = result.stats
    depth_rates = " ".join(f"{r:.2f}" for r in stats.acceptance_by_depth())
    print(
        f"\n\n[{target.name}] {stats.new_tokens} tokens, finish={result.finish_reason.value}, "
        f"tau={stats.tau:.2f}, acceptance by depth=[{depth_rates}], "
        f"prefill={stats.prefill_seconds * 1000:.0f} ms, decode={stats.decode_seconds:.2f} s "
        f"({stats.decode_tokens_per_second:.1f} tok/s)",
        file=sys.stderr,
    )
    return 0
