"""Run the robustness evaluation that `selfspec eval` asks for, and write its outputs."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tqdm import tqdm

from selfspec.adapters.prompts import default_prompts_file, encode_prompts, read_prompt_file
from selfspec.adapters.robustness import (
    BASE,
    EvalSettings,
    RobustnessReport,
    machine,
    measure,
    with_ratios,
)
from selfspec.adapters.select import store_for
from selfspec.adapters.validate import META_FILE
from selfspec.atomic import write_text_atomic
from selfspec.cost_curve import machine_cost_curve, needs_cost_curve
from selfspec.generation import SpeculativeGenerator
from selfspec.heads import load_heads
from selfspec.shipped import resolve_heads_dir
from selfspec.target import load_target
from selfspec.tree import parse_tree_spec


def run_evaluation(args: Any) -> tuple[RobustnessReport, list[Path]]:
    """`args`: an `EvalArgs`. Returns the report and the files written."""
    is_default = args.is_default_target
    target = load_target(args.target_spec())
    model = target.model
    heads = _heads(args.heads, model, is_default)
    prompts_path = Path(args.prompts) if args.prompts else default_prompts_file()
    prompts = encode_prompts(target.tokenizer, read_prompt_file(prompts_path, args.max_prompts))
    store = store_for(model, args.adapters_root, is_default)
    names = [store.resolve(a) for a in args.adapters] if args.adapters else list(store.names())
    if not names:
        raise ValueError(
            "no adapters to evaluate: give --adapters-root DIR or --adapters NAME_OR_DIR ..."
            + (f" (rejected: {store.rejected})" if store.rejected else "")
        )
    settings = EvalSettings(
        max_new_tokens=args.max_new_tokens,
        tree=parse_tree_spec(args.tree),
        context_drafts=args.context_drafts_config(),
    )
    curve = machine_cost_curve(model) if needs_cost_curve(settings.tree) else None
    corpus = args.corpus_for(model, is_default)
    shared = SpeculativeGenerator(model, heads, target.tokenizer, curve)
    shared.corpus = corpus
    row_count = 1 + sum(1 + (store.info(n).heads_path is not None) for n in names)
    with tqdm(total=row_count * len(prompts), desc="eval", unit="prompt") as progress:
        progress.set_postfix_str(BASE)
        rows = [
            measure(
                shared, prompts, settings, scope=store.scope(None), name=BASE, progress=progress
            )
        ]
        for name in names:
            info = store.info(name)
            # The shared heads always (what the adapter keeps of them), and the adapter's own
            # recalibrated heads too when it carries some (what serving it uses by default).
            generators = [(shared, "base")]
            if info.heads_path is not None:
                own = load_heads(info.heads_path, model)
                own_generator = SpeculativeGenerator(model, own, target.tokenizer, curve)
                own_generator.corpus = corpus
                generators.append((own_generator, "own"))
            with store.pinned(name):
                for generator, heads_kind in generators:
                    progress.set_postfix_str(f"{name} ({heads_kind} heads)")
                    rows.append(
                        measure(
                            generator,
                            prompts,
                            settings,
                            scope=store.scope(name),
                            name=name,
                            heads=heads_kind,
                            meta=_meta(info.path),
                            progress=progress,
                            base_scope=store.scope(None),
                        )
                    )
    report = RobustnessReport(
        rows=with_ratios(rows),
        settings={
            "target": target.name,
            "heads": args.heads if args.heads in ("eagle", "medusa") else Path(args.heads).name,
            "dtype": args.dtype,
            "activations": args.activations,
            "context_drafts": args.context_drafts,
            "draft_corpus": None if corpus is None else args.draft_corpus,
            "prompts": f"{prompts_path.name} (first {len(prompts)})",
            "max_new_tokens": args.max_new_tokens,
            "tree": args.tree,
            **machine(),
        },
    )
    return report, write_report(report, Path(args.out), plot=args.plot)


def write_report(report: RobustnessReport, out: Path, plot: bool = True) -> list[Path]:
    written = [
        write_text_atomic(out / "robustness.json", json.dumps(report.to_dict(), indent=2) + "\n"),
        write_text_atomic(out / "robustness.md", report.to_markdown()),
    ]
    if plot:
        from selfspec.adapters.plot import plot_report

        written.append(plot_report(report, out / "robustness.png"))
    return written


def _heads(spec: str, model: Any, is_default: bool) -> Any:
    return load_heads(resolve_heads_dir(spec, is_default), model)


def _meta(directory: Path) -> dict[str, Any]:
    path = directory / META_FILE
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError:
        return {}
    return {"metrics": data.get("metrics", {})} if isinstance(data, dict) else {}
