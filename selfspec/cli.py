"""The ``selfspec`` command: dispatches to each wing's own CLI, imported only when used.

The core never imports a wing; a wing that is not installed gets a message naming its extra.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Sequence

# command -> (module, function, extra that provides it, one-line description)
COMMANDS: dict[str, tuple[str, str, str | None, str]] = {
    "generate": ("selfspec.cli_generate", "main", None, "generate text with speculative decoding"),
    "distill": (
        "selfspec.train.cli",
        "distill_main",
        "train",
        "self-distil responses from the target",
    ),
    "datagen": (
        "selfspec.train.cli",
        "datagen_main",
        "train",
        "data engine: prompts written by the target, deduplicated, answered, in shards",
    ),
    "train": ("selfspec.train.cli", "train_main", "train", "train draft heads with Lightning"),
    "corpus": (
        "selfspec.train.cli",
        "corpus_main",
        "train",
        "a draft corpus from the target's own responses, for context drafts' retrieval",
    ),
    "recalibrate": (
        "selfspec.train.cli",
        "recalibrate_main",
        "train",
        "fine-tune heads for one adapter, save them beside it, tau before/after",
    ),
    "eval": (
        "selfspec.adapters.cli",
        "eval_main",
        "adapters",
        "adapter robustness: tau, acceptance and speedup per adapter vs the base",
    ),
    "adapters": (
        "selfspec.adapters.cli",
        "adapters_main",
        "adapters",
        "list the adapters of a root, valid or rejected (with why)",
    ),
    "serve": (
        "selfspec.serve.cli",
        "main",
        "serve",
        "OpenAI-compatible server: the base model and its LoRA adapters, speculating",
    ),
    "export": (
        "selfspec.cli_interop",
        "export_main",
        None,
        "write EAGLE-3 heads as a speculators drafter (the format vLLM loads)",
    ),
    "import": (
        "selfspec.cli_interop",
        "import_main",
        None,
        "read a speculators EAGLE-3 drafter or FasterDecoding Medusa heads as selfspec heads",
    ),
}


def usage() -> str:
    lines = [
        "usage: selfspec COMMAND [options]   (selfspec COMMAND --help for its options)",
        "",
        "commands:",
    ]
    lines += [f"  {name:<10} {spec[3]}" for name, spec in COMMANDS.items()]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command not in COMMANDS:
        print(f"selfspec: unknown command {command!r}\n\n{usage()}", file=sys.stderr)
        return 2
    module_name, function, extra, _ = COMMANDS[command]
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as error:
        if extra is None or (error.name or "").startswith("selfspec"):
            raise
        print(
            f"selfspec {command} needs the '{extra}' extra ({error.name} is missing): "
            f"pip install 'selfspec[{extra}]'",
            file=sys.stderr,
        )
        return 2
    return int(getattr(module, function)(rest) or 0)


if __name__ == "__main__":
    raise SystemExit(main())
