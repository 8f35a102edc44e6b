"""``selfspec eval``: adapter robustness of the heads, with a CI gate; ``selfspec adapters``.

    selfspec eval [--adapters-root DIR] [--adapters A B ...] [--prompts FILE.jsonl]
                  [--min-ratio 0.8] [--out DIR]

For the base and every adapter: τ, acceptance per depth, tokens/s with and without speculation
(side by side in one run), greedy equality with vanilla decoding. Writes `robustness.json`,
`robustness.md` and `robustness.png` into --out. Exit status: 0 when every adapter keeps
τ / τ_base >= --min-ratio and every output is lossless; 1 otherwise, listing what failed; 2 on
bad input.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field

from selfspec.cli_args import parse_dataclass
from selfspec.draft_options import DraftOptions
from selfspec.target_options import TargetOptions
from selfspec.tree import parse_tree_spec

PROG = "selfspec eval"
DESCRIPTION = (
    "For the base and every adapter: tau, acceptance per depth, tokens/s with and without "
    "speculation (side by side), greedy equality with vanilla decoding. Writes robustness.json, "
    "robustness.md and robustness.png into --out. Exit 0 when every adapter keeps "
    "tau / tau_base >= --min-ratio and every output is lossless, 1 otherwise, 2 on bad input."
)


@dataclass(frozen=True, kw_only=True)
class EvalArgs(DraftOptions, TargetOptions):
    """The target's options (`TargetOptions`) and the drafting ones (`DraftOptions`: context
    drafts and their corpus, on by default as when serving), then these."""

    heads: str = field(
        default="eagle", metadata={"help": "heads dir, or 'eagle' / 'medusa' (shipped heads)"}
    )
    adapters_root: str | None = field(
        default=None,
        metadata={"help": "directory of adapter directories (default: the shipped examples)"},
    )
    adapters: tuple[str, ...] = field(
        default=(), metadata={"help": "adapter names or directories (default: all under the root)"}
    )
    prompts: str | None = field(
        default=None, metadata={"help": "JSONL prompts file (default: the held-out prompts)"}
    )
    max_prompts: int = field(default=16, metadata={"help": "first N prompts of the file"})
    max_new_tokens: int = field(default=64, metadata={"help": "tokens generated per prompt"})
    tree: str = field(default="auto", metadata={"help": "tree spec, as for selfspec generate"})
    out: str = field(default="robustness", metadata={"help": "output directory"})
    min_ratio: float | None = field(
        default=None, metadata={"help": "gate: fail if an adapter's tau / base tau is below this"}
    )
    plot: bool = field(default=True, metadata={"help": "write robustness.png (needs matplotlib)"})

    def __post_init__(self) -> None:
        super().__post_init__()
        parse_tree_spec(self.tree)
        if self.max_prompts < 1:
            raise ValueError(f"--max-prompts must be >= 1, got {self.max_prompts}")
        if self.max_new_tokens < 2:
            raise ValueError(f"--max-new-tokens must be >= 2, got {self.max_new_tokens}")
        if self.min_ratio is not None and not self.min_ratio > 0:
            raise ValueError(f"--min-ratio must be > 0, got {self.min_ratio}")


def eval_main(argv: Sequence[str]) -> int:
    args = parse_dataclass(EvalArgs, argv, description=DESCRIPTION, prog=PROG)
    from selfspec.adapters.evaluate import run_evaluation

    try:
        report, written = run_evaluation(args)
    except (FileNotFoundError, ValueError) as error:
        print(f"{PROG}: error: {error}", file=sys.stderr)
        return 2
    print(report.to_markdown())
    print("wrote " + ", ".join(str(p) for p in written), file=sys.stderr)
    failed = False
    for row in report.mismatched():
        failed = True
        print(
            f"{PROG}: NOT LOSSLESS: {row.name}: speculative output differs from vanilla on "
            f"prompts {list(row.mismatched_prompts)}",
            file=sys.stderr,
        )
    if args.min_ratio is not None:
        below = report.below(args.min_ratio)
        if below:
            failed = True
            listed = ", ".join(f"{row.name} ({row.tau_ratio:.2f})" for row in below)
            print(f"{PROG}: below --min-ratio {args.min_ratio}: {listed}", file=sys.stderr)
    return 1 if failed else 0


def adapters_main(argv: Sequence[str]) -> int:
    """``selfspec adapters [--adapters-root DIR] [--model M]``: list adapters, valid or not."""
    import argparse

    parser = argparse.ArgumentParser(prog="selfspec adapters", description=adapters_main.__doc__)
    parser.add_argument("--adapters-root", default=None, help="default: the shipped examples")
    parser.add_argument("--model", default=None, help="target the adapters are checked against")
    args = parser.parse_args(list(argv))
    from selfspec.adapters.select import store_for
    from selfspec.target import TargetLoadError, TargetSpec, load_target

    try:
        target = load_target(TargetSpec(model=args.model))
        store = store_for(target.model, args.adapters_root, args.model in (None, "default"))
    except (TargetLoadError, ValueError) as error:
        print(f"selfspec adapters: error: {error}", file=sys.stderr)
        return 2
    listing = {
        "root": str(store.root) if store.root else None,
        "adapters": [store.info(name).to_dict() for name in store.names()],
        "rejected": store.rejected,
    }
    print(json.dumps(listing, indent=2))
    return 0
