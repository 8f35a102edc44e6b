"""τ of draft heads on the team's held-out benchmark prompts, per category, greedy and sampled.

    .venv/bin/python benchmarks/tau_heldout.py --out runs/tau_heldout
    .venv/bin/python benchmarks/tau_heldout.py --heads eagle3=runs/eagle3/heads --limit 2

Every heads set (by default the shipped EAGLE and Medusa heads, plus each `--heads`) decodes
every prompt of `benchmarks/heldout/prompts.jsonl` (six categories: mt, translation,
summarization, qa, math, rag) with one fixed dynamic tree (top-k 10, depth 7, 60 nodes: no cost
curve, so the numbers do not depend on the machine), in float32, at each temperature: T=0
greedy, T>0 lossless recursive rejection sampling with a fixed seed per prompt, so a rerun
repeats exactly.

τ = tokens committed per target forward, bonus included (vanilla decoding: 1.00), pooled over
all decode steps of all prompts of a category (as `selfspec.train.tau` measures it), with the
acceptance rate per depth beside it. **mean τ** is the unweighted mean of the category τs (each
category counts alike, as the "Mean" column of the EAGLE-2/3 tables); **pooled τ** pools every
step of every category (total tokens / total forwards). Medusa drafts no deeper than its number
of heads, so its tree's depth is capped there, and the table says so. By default each heads set
is measured twice: drafting alone, and with chains copied from the request's own context grafted
into its tree (row "NAME + context", the default of `selfspec generate` and `serve`; the tree's
depth and node budget bound both alike); `--context-drafts on|off` measures one of them.

Before anything is measured, every held-out prompt is compared with the training prompts
(`train/data/prompts.jsonl` and each `--train-data`: a prompts JSONL / datasets directory, or a
distilled dataset from `selfspec distill`, whose prompts are decoded from its token ids): the
Jaccard similarity of word 5-gram sets. A held-out prompt at or above `--dedup-threshold` is a
near duplicate of training data, and the script stops with exit status 2, naming it.

Writes OUT/results.json (every number, the settings, wall times), OUT/results.md (the tables)
and, where matplotlib is installed, OUT/tau_per_category.png.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import statistics
import sys
import time
import zlib
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from torch import nn

from selfspec.atomic import write_file_atomic
from selfspec.draft_options import CONTEXT_MODES, add_context_draft_arguments
from selfspec.drafting.context import ContextDrafts
from selfspec.drafting.corpus import DraftCorpus
from selfspec.generation import GenerationConfig, SpeculativeGenerator
from selfspec.heads import HeadKind, load_heads
from selfspec.reports import machine_record, write_report
from selfspec.sampling import SamplingParams
from selfspec.shipped import resolve_corpus, shipped_heads_dir
from selfspec.target import TargetSpec, apply_chat_template, load_target
from selfspec.train.tau import decode_steps, pooled_tau
from selfspec.tree import DraftSampling, DynamicTree

ROOT = Path(__file__).resolve().parents[1]
HELDOUT = ROOT / "benchmarks" / "heldout" / "prompts.jsonl"
TRAIN_PROMPTS = ROOT / "train" / "data" / "prompts.jsonl"
FIXED_TREE = DynamicTree(top_k=10, depth=7, budget=60)
GOALS = {0.0: (3.0, 2.3), 1.0: (2.6, None)}
"""Temperature -> (mean τ at least, every category τ at least), the issue's goals."""
DEDUP_EXIT = 2


class HeldoutError(ValueError):
    """A held-out prompts file that cannot be used; the message names the file and line."""


@dataclass(frozen=True)
class HeldoutPrompt:
    id: str
    category: str
    prompt: str


@dataclass(frozen=True)
class HeadsRun:
    """One heads set under measurement, with the tree it is measured with."""

    name: str
    heads: nn.Module
    tree: DynamicTree
    note: str = ""
    """Why the tree differs from the requested one (Medusa's depth), else empty."""
    source: str = ""
    """Where the heads came from (a directory), for the record."""
    context_drafts: ContextDrafts | None = None
    """Also draft chains copied from the request's context (``selfspec.drafting.context``)."""


# -- the held-out prompts ---------------------------------------------------------------------


def read_heldout(path: Path) -> list[HeldoutPrompt]:
    """Every held-out prompt of ``path`` ({"id", "category", "prompt"} per line), in file order."""
    if not path.is_file():
        raise HeldoutError(f"held-out prompts {path} is not a file")
    prompts: list[HeldoutPrompt] = []
    seen: set[str] = set()
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as error:
            raise HeldoutError(f"{path}:{number}: not JSON: {error.msg}") from None
        fields = ("id", "category", "prompt")
        if not isinstance(row, dict) or not all(
            isinstance(row.get(k), str) and row[k].strip() for k in fields
        ):
            raise HeldoutError(f'{path}:{number}: expected {{"id", "category", "prompt"}} strings')
        if row["id"] in seen:
            raise HeldoutError(f"{path}:{number}: duplicate id {row['id']!r}")
        seen.add(row["id"])
        prompts.append(HeldoutPrompt(row["id"], row["category"], row["prompt"]))
    if not prompts:
        raise HeldoutError(f"{path} holds no prompt")
    return prompts


def select(
    prompts: Sequence[HeldoutPrompt],
    categories: Sequence[str] | None = None,
    limit: int | None = None,
) -> list[HeldoutPrompt]:
    """``prompts`` of ``categories`` (all when None, else in that order), the first ``limit`` of
    each."""
    groups = by_category(prompts)
    if categories:
        unknown = [c for c in categories if c not in groups]
        if unknown:
            raise HeldoutError(f"no held-out category {unknown}; there are {list(groups)}")
        groups = {c: groups[c] for c in categories}
    return [p for group in groups.values() for p in (group[:limit] if limit else group)]


def by_category(prompts: Iterable[HeldoutPrompt]) -> dict[str, list[HeldoutPrompt]]:
    """Prompts grouped by category, categories in order of first appearance."""
    groups: dict[str, list[HeldoutPrompt]] = {}
    for prompt in prompts:
        groups.setdefault(prompt.category, []).append(prompt)
    return groups


# -- deduplication against the training data --------------------------------------------------


@dataclass(frozen=True)
class NearestTraining:
    """The training prompt most similar to one held-out prompt."""

    heldout_id: str
    jaccard: float
    source: str
    """Where the training prompt is: FILE:LINE, or DIR[row]."""
    text: str


def shingles(text: str, n: int) -> set[tuple[str, ...]]:
    """Word n-grams of ``text`` (lowercased, punctuation dropped); a text of fewer than ``n``
    words is one shingle of all its words, so exact short duplicates still match."""
    words = re.findall(r"\w+", text.lower())
    if len(words) < n:
        return {tuple(words)} if words else set()
    return {tuple(words[i : i + n]) for i in range(len(words) - n + 1)}


def nearest_training(
    heldout: Sequence[HeldoutPrompt], training: Sequence[tuple[str, str]], n: int = 5
) -> list[NearestTraining]:
    """For each held-out prompt, the training prompt ((source, text) pairs) with the highest
    Jaccard similarity of word n-gram sets, found exactly through an inverted index."""
    index: dict[tuple[str, ...], list[int]] = {}
    sizes = []
    for row, (_, text) in enumerate(training):
        grams = shingles(text, n)
        sizes.append(len(grams))
        for gram in grams:
            index.setdefault(gram, []).append(row)
    nearest = []
    for prompt in heldout:
        grams = shingles(prompt.prompt, n)
        shared = Counter(row for gram in grams for row in index.get(gram, ()))
        best_row, best = -1, 0.0
        for row, common in shared.items():
            jaccard = common / (len(grams) + sizes[row] - common)
            if jaccard > best:
                best_row, best = row, jaccard
        source, text = training[best_row] if best_row >= 0 else ("-", "")
        nearest.append(NearestTraining(prompt.id, round(best, 4), source, text))
    return nearest


def near_duplicates(nearest: Sequence[NearestTraining], threshold: float) -> list[NearestTraining]:
    """The held-out prompts whose nearest training prompt reaches ``threshold``."""
    return [match for match in nearest if match.jaccard >= threshold]


def prompt_text(prompt: str | list[dict[str, str]]) -> str:
    """A prompt record's words: the string, or the contents of a conversation's messages."""
    if isinstance(prompt, str):
        return prompt
    return "\n".join(message["content"] for message in prompt)


def read_training_prompts(path: Path, tokenizer: Any) -> list[tuple[str, str]]:
    """(source, text) of every prompt in ``path``: a prompts JSONL or datasets directory
    (`selfspec.train.prompts`), or a distilled dataset (`selfspec.train.shards`), whose prompt
    tokens are decoded with ``tokenizer`` and stripped of the chat template's frame."""
    from selfspec.train.prompts import OnBadLine, read_prompts
    from selfspec.train.shards import load_distilled

    if path.is_dir() and any(path.glob("shard-*")):
        data = load_distilled(path).select_columns(["input_ids", "prompt_len"])
        prefix, suffix = chat_frame(tokenizer)
        special = [t for t in tokenizer.all_special_tokens if t]
        texts: dict[str, str] = {}  # a prompt distilled into several rows counts once
        for row, (ids, length) in enumerate(
            zip(data["input_ids"], data["prompt_len"], strict=True)
        ):
            text = strip_frame(tokenizer.decode(ids[:length]), prefix, suffix, special)
            texts.setdefault(text, f"{path}[{row}]")
        return [(source, text) for text, source in texts.items()]
    records, _ = read_prompts(path, OnBadLine.skip)
    line = ":" if path.is_file() else "["
    close = "" if path.is_file() else "]"
    return [(f"{path}{line}{r.source_index}{close}", prompt_text(r.prompt)) for r in records]


def chat_frame(tokenizer: Any) -> tuple[str, str]:
    """The decoded text the chat template puts before and after one user message (e.g. a
    default system prompt), so that it does not count as words shared by every prompt."""
    marker = "HELDOUTMARKER"
    text = tokenizer.decode(apply_chat_template(tokenizer, marker))
    if marker not in text:
        return "", ""
    prefix, _, suffix = text.partition(marker)
    return prefix, suffix


def strip_frame(text: str, prefix: str, suffix: str, special: Sequence[str]) -> str:
    """``text`` without the chat template's frame and special-token strings."""
    if prefix and text.startswith(prefix):
        text = text[len(prefix) :]
    if suffix and text.endswith(suffix):
        text = text[: -len(suffix)]
    for token in special:
        text = text.replace(token, " ")
    return text.strip()


def check_deduplicated(
    heldout: Sequence[HeldoutPrompt],
    training_paths: Sequence[Path],
    tokenizer: Any,
    threshold: float,
    n: int,
) -> dict[str, Any]:
    """Compare every held-out prompt with every training prompt; the report of the check
    ({"passed", "max_jaccard", "duplicates", ...}). Prints the largest similarities."""
    training: list[tuple[str, str]] = []
    for path in training_paths:
        training.extend(read_training_prompts(path, tokenizer))
    nearest = nearest_training(heldout, training, n)
    duplicates = near_duplicates(nearest, threshold)
    ranked = sorted(nearest, key=lambda m: m.jaccard, reverse=True)
    print(
        f"dedup: {len(heldout)} held-out prompts vs {len(training)} training prompts "
        f"({', '.join(str(p) for p in training_paths)}), word {n}-gram Jaccard; "
        f"max {ranked[0].jaccard:.3f} ({ranked[0].heldout_id} ~ {ranked[0].source}), "
        f"threshold {threshold}"
    )
    return {
        "passed": not duplicates,
        "threshold": threshold,
        "ngram": n,
        "training_sources": [str(p) for p in training_paths],
        "training_prompts": len(training),
        "max_jaccard": ranked[0].jaccard,
        "duplicates": [asdict(d) | {"text": d.text[:200]} for d in duplicates],
        "top": [asdict(m) | {"text": m.text[:120]} for m in ranked[:5]],
    }


# -- measuring --------------------------------------------------------------------------------


def tree_for_heads(heads: nn.Module, tree: DynamicTree) -> tuple[DynamicTree, str]:
    """The tree ``heads`` can draft: Medusa drafts no deeper than its number of heads."""
    config = heads.config
    if config.kind is HeadKind.MEDUSA and config.num_heads < tree.depth:
        note = f"depth capped at its {config.num_heads} heads"
        return replace(tree, depth=config.num_heads), note
    return tree, ""


def tree_label(tree: DynamicTree) -> str:
    return f"dynamic k{tree.top_k} d{tree.depth} n{tree.budget}"


def prompt_seed(seed: int, prompt_id: str) -> int:
    """A prompt's sampling seed: fixed by its id, whatever else is measured or left out."""
    return zlib.crc32(f"{seed}:{prompt_id}".encode())


def measure_run(
    generator: SpeculativeGenerator,
    run: HeadsRun,
    prompts: Sequence[HeldoutPrompt],
    temperature: float,
    max_new_tokens: int,
    seed: int = 0,
    draft_sampling: DraftSampling = DraftSampling.WITHOUT_REPLACEMENT,
    stop_token_ids: tuple[int, ...] | None = None,
) -> dict[str, Any]:
    """τ of one heads set at one temperature: per category, pooled and mean over categories.

    {"heads", "temperature", "tree", "note", "categories": {category: {"tau",
    "acceptance_by_depth", "target_forwards", "prompts", "decode_tokens",
    "decode_tokens_per_s"}}, "pooled": {...}, "mean_tau", "min_category", "wall_seconds"}
    """
    config = GenerationConfig(
        max_new_tokens=max_new_tokens,
        sampling=SamplingParams(temperature=temperature),
        tree=run.tree,
        draft_sampling=draft_sampling,
        context_drafts=run.context_drafts,
        stop_token_ids=stop_token_ids,
    )
    tokenizer = generator.tokenizer
    started = time.perf_counter()
    categories: dict[str, dict[str, Any]] = {}
    every_step = []
    for category, group in by_category(prompts).items():
        prompt_ids = [apply_chat_template(tokenizer, p.prompt) for p in group]  # [S] each
        seeds = [prompt_seed(seed, p.id) for p in group]
        desc = f"{run.name} T={temperature:g} {category}"
        steps, tokens, seconds = decode_steps(generator, prompt_ids, config, desc, seeds)
        every_step.extend(steps)
        categories[category] = pooled_tau(steps) | {
            "prompts": len(group),
            "decode_tokens": tokens,
            "decode_tokens_per_s": round(tokens / seconds, 2) if seconds else 0.0,
        }
    taus = {category: result["tau"] for category, result in categories.items()}
    lowest = min(taus, key=taus.__getitem__)
    return {
        "heads": run.name,
        "source": run.source,
        "temperature": temperature,
        "tree": vars(run.tree),
        "context_drafts": None if run.context_drafts is None else asdict(run.context_drafts),
        "note": run.note,
        "categories": categories,
        "pooled": pooled_tau(every_step),
        "mean_tau": round(statistics.mean(taus.values()), 4),
        "min_category": {"category": lowest, "tau": taus[lowest]},
        "wall_seconds": round(time.perf_counter() - started, 1),
    }


def measure(
    model: nn.Module,
    tokenizer: Any,
    runs: Sequence[HeadsRun],
    prompts: Sequence[HeldoutPrompt],
    temperatures: Sequence[float],
    max_new_tokens: int,
    seed: int = 0,
    draft_sampling: DraftSampling = DraftSampling.WITHOUT_REPLACEMENT,
    stop_token_ids: tuple[int, ...] | None = None,
    corpus: DraftCorpus | None = None,
) -> list[dict[str, Any]]:
    """One row (``measure_run``'s result) per heads set x temperature, heads-major.

    ``stop_token_ids=()`` decodes every prompt to ``max_new_tokens`` (None: stop at EOS).
    ``corpus``: where context drafts also retrieve chains from (runs with context drafts)."""
    rows = []
    for run in runs:
        generator = SpeculativeGenerator(model, run.heads, tokenizer)  # no cost curve: fixed tree
        generator.corpus = corpus
        for temperature in temperatures:
            rows.append(
                measure_run(
                    generator,
                    run,
                    prompts,
                    temperature,
                    max_new_tokens,
                    seed,
                    draft_sampling,
                    stop_token_ids,
                )
            )
    return rows


def meets_goal(row: dict[str, Any]) -> str:
    """ "yes" / "no" against the issue's goal at the row's temperature, "" where it sets none."""
    goal = GOALS.get(float(row["temperature"]))
    if goal is None:
        return ""
    mean_goal, category_goal = goal
    ok = row["mean_tau"] >= mean_goal
    if category_goal is not None:
        ok = ok and row["min_category"]["tau"] >= category_goal
    return "yes" if ok else "no"


# -- loading ----------------------------------------------------------------------------------


def parse_heads_arg(text: str) -> tuple[str, Path]:
    """``NAME=DIR`` or ``DIR`` (named after the directory)."""
    name, sep, path = text.partition("=")
    if not sep:
        path = text
        name = Path(text.rstrip("/")).name
    if not name or not path:
        raise argparse.ArgumentTypeError(f"--heads expects NAME=DIR or DIR, got {text!r}")
    return name, Path(path).expanduser()


def load_runs(
    model: nn.Module,
    shipped: Sequence[str],
    extra: Sequence[tuple[str, Path]],
    tree: DynamicTree,
    context: str = "off",
) -> list[HeadsRun]:
    """The shipped heads named in ``shipped``, then each (name, directory) of ``extra``, each
    with the tree it can draft, alone and/or with context drafts as ``context`` says."""
    sources = [(kind, shipped_heads_dir(kind)) for kind in shipped] + list(extra)
    names = [name for name, _ in sources]
    if len(set(names)) != len(names):
        raise ValueError(f"heads names must differ, got {names}; name them with NAME=DIR")
    runs = []
    for name, path in sources:
        heads = load_heads(path, model)
        heads_tree, note = tree_for_heads(heads, tree)
        for with_context in CONTEXT_MODES[context]:
            label = f"{name} + context" if with_context else name
            drafts = ContextDrafts() if with_context else None
            runs.append(HeadsRun(label, heads, heads_tree, note, str(path), drafts))
    return runs


# -- reporting --------------------------------------------------------------------------------


def markdown(report: dict[str, Any]) -> str:
    """The τ table (heads x temperature rows, one column per category) and the acceptance per
    depth table."""
    settings = report["settings"]
    categories = settings["categories"]
    machine = report["machine"]
    lines = [
        f"τ on held-out prompts ({settings['prompts']} prompts: {settings['per_category']}), "
        f"{settings['dtype']}, {settings['max_new_tokens']} new tokens, tree "
        f"{tree_label(DynamicTree(**settings['tree']))}, T>0 by recursive rejection sampling "
        f"(seed {settings['seed']}); {machine['cpu']} ({' '.join(machine['flags'])}), kernels "
        f"{machine['kernels']}, {report['date']}. mean τ = unweighted mean of the category τs; "
        "pooled τ = all steps of all categories.",
        "",
        "| heads | T | tree | " + " | ".join(categories) + " | mean τ | pooled τ | min category "
        "| goal |",
        "|---|---:|---|" + "---:|" * len(categories) + "---:|---:|---|---|",
    ]
    for row in report["rows"]:
        tree = tree_label(DynamicTree(**row["tree"])) + (f" ({row['note']})" if row["note"] else "")
        taus = " | ".join(f"{row['categories'][c]['tau']:.2f}" for c in categories)
        lowest = row["min_category"]
        lines.append(
            f"| {row['heads']} | {row['temperature']:g} | {tree} | {taus} | "
            f"{row['mean_tau']:.2f} | {row['pooled']['tau']:.2f} | "
            f"{lowest['category']} {lowest['tau']:.2f} | {meets_goal(row)} |"
        )
    goals = "; ".join(
        f"T={t:g}: mean τ ≥ {m}" + (f", every category ≥ {c}" if c else "")
        for t, (m, c) in GOALS.items()
    )
    lines += [
        "",
        f"Goal (issue): {goals}.",
        "",
        "Acceptance per depth d, pooled: of the steps whose tree reached d, the share whose "
        "accepted path reached it.",
        "",
    ]
    depth = max(len(row["pooled"]["acceptance_by_depth"]) for row in report["rows"])
    lines += [
        "| heads | T | " + " | ".join(f"d{d}" for d in range(1, depth + 1)) + " | forwards |",
        "|---|---:|" + "---:|" * (depth + 1),
    ]
    for row in report["rows"]:
        rates = row["pooled"]["acceptance_by_depth"]
        cells = [f"{r:.3f}" for r in rates] + [""] * (depth - len(rates))
        lines.append(
            f"| {row['heads']} | {row['temperature']:g} | {' | '.join(cells)} | "
            f"{row['pooled']['target_forwards']} |"
        )
    dedup = report["dedup"]
    lines += [
        "",
        f"Deduplication: max word {dedup['ngram']}-gram Jaccard with {dedup['training_prompts']} "
        f"training prompts {dedup['max_jaccard']:.3f} (threshold {dedup['threshold']}).",
    ]
    return "\n".join(lines) + "\n"


def plot(report: dict[str, Any], path: Path) -> Path | None:
    """Grouped bars: τ per category, one bar per heads x temperature; None without matplotlib."""
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    categories = [*report["settings"]["categories"], "mean"]
    rows = report["rows"]
    width = 0.8 / len(rows)
    figure, axis = plt.subplots(figsize=(2 + 1.3 * len(categories), 4.5))
    for i, row in enumerate(rows):
        values = [row["categories"][c]["tau"] for c in categories[:-1]] + [row["mean_tau"]]
        xs = [x + (i - (len(rows) - 1) / 2) * width for x in range(len(categories))]
        axis.bar(xs, values, width, label=f"{row['heads']} T={row['temperature']:g}")
    for temperature, (mean_goal, _) in GOALS.items():
        axis.axhline(mean_goal, color="#7f7f7f", linestyle="--", linewidth=0.8)
        axis.annotate(
            f"goal T={temperature:g}",
            (len(categories) - 0.5, mean_goal),
            ha="right",
            va="bottom",
            fontsize=7,
        )
    axis.axhline(1.0, color="black", linewidth=0.8)
    axis.set_xticks(range(len(categories)), categories)
    axis.set_ylabel("τ (tokens per target forward)")
    axis.grid(axis="y", alpha=0.3)
    axis.legend(fontsize=7)
    settings = report["settings"]
    figure.suptitle(
        f"τ per held-out category, tree {tree_label(DynamicTree(**settings['tree']))}, "
        f"{settings['max_new_tokens']} tokens, {settings['dtype']}",
        fontsize=9,
    )
    return save_figure(figure, path)


def save_figure(figure: Any, path: Path) -> Path:
    """Lay ``figure`` out, write it to ``path`` atomically, close it."""
    from matplotlib import pyplot as plt

    figure.tight_layout()
    try:
        return write_file_atomic(path, lambda temporary: figure.savefig(temporary, dpi=110))
    finally:
        plt.close(figure)


def file_digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()[:16]


# -- the command ------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        epilog="mean τ = unweighted mean of the category τs; pooled τ = over all steps. "
        f"Exit status {DEDUP_EXIT}: a held-out prompt is a near duplicate of training data.",
    )
    parser.add_argument(
        "--prompts",
        type=Path,
        default=HELDOUT,
        help='held-out JSONL of {"id", "category", "prompt"}',
    )
    parser.add_argument(
        "--categories",
        nargs="+",
        default=None,
        help="measure only these categories; all when not given",
    )
    parser.add_argument(
        "--limit", type=int, default=None, help="first N prompts of each category (quick runs)"
    )
    parser.add_argument(
        "--shipped",
        nargs="*",
        choices=[HeadKind.EAGLE.value, HeadKind.MEDUSA.value],
        default=[HeadKind.EAGLE.value, HeadKind.MEDUSA.value],
        help="shipped heads to measure (default: eagle medusa; `--shipped` alone: none)",
    )
    parser.add_argument(
        "--heads",
        action="append",
        type=parse_heads_arg,
        default=[],
        metavar="[NAME=]DIR",
        help="a heads directory (`selfspec train` output, any kind incl. eagle3); repeatable",
    )
    parser.add_argument("--top-k", type=int, default=FIXED_TREE.top_k, help="tree top-k")
    parser.add_argument("--depth", type=int, default=FIXED_TREE.depth, help="tree depth")
    parser.add_argument(
        "--budget", type=int, default=FIXED_TREE.budget, help="tree nodes kept (root excluded)"
    )
    parser.add_argument("--max-new-tokens", type=int, default=96, help="per prompt")
    add_context_draft_arguments(parser)
    parser.add_argument(
        "--temperatures", type=float, nargs="+", default=[0.0, 1.0], help="0: greedy"
    )
    parser.add_argument("--seed", type=int, default=0, help="base of the per-prompt seeds")
    parser.add_argument(
        "--draft-sampling",
        choices=[s.value for s in DraftSampling],
        default=DraftSampling.WITHOUT_REPLACEMENT.value,
        help="how a node's children are drafted at T>0; changes acceptance, never the output's law",
    )
    parser.add_argument(
        "--ignore-eos",
        action="store_true",
        help="decode every prompt to --max-new-tokens (default: stop at EOS)",
    )
    parser.add_argument(
        "--dtype", default="float32", help="target dtype (the issue's numbers: float32)"
    )
    parser.add_argument("--threads", type=int, default=None, help="torch threads")
    parser.add_argument(
        "--train-data",
        type=Path,
        action="append",
        default=[],
        help="more training data to deduplicate against: a prompts JSONL / datasets directory "
        "or a distilled dataset directory; repeatable (train/data/prompts.jsonl always counts)",
    )
    parser.add_argument(
        "--dedup-threshold",
        type=float,
        default=0.5,
        help="word n-gram Jaccard at which a held-out prompt is a near duplicate",
    )
    parser.add_argument("--dedup-ngram", type=int, default=5, help="words per shingle")
    parser.add_argument(
        "--check-only", action="store_true", help="run the deduplication check and stop"
    )
    parser.add_argument("--no-plot", action="store_true", help="skip tau_per_category.png")
    parser.add_argument(
        "--out", type=Path, default=Path("runs/tau_heldout"), help="results.json, results.md, plot"
    )
    args = parser.parse_args(argv)
    if args.limit is not None and args.limit < 1:
        parser.error(f"--limit must be >= 1, got {args.limit}")
    if not 0.0 < args.dedup_threshold <= 1.0:
        parser.error(f"--dedup-threshold must be in (0, 1], got {args.dedup_threshold}")
    if any(t < 0 for t in args.temperatures):
        parser.error(f"--temperatures must be >= 0, got {args.temperatures}")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.perf_counter()
    try:
        every_prompt = read_heldout(args.prompts)
        prompts = select(every_prompt, args.categories, args.limit)
        tree = DynamicTree(top_k=args.top_k, depth=args.depth, budget=args.budget)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    target = load_target(TargetSpec(dtype=args.dtype, threads=args.threads))
    # The whole file is checked, whatever --limit / --categories measure.
    dedup = check_deduplicated(
        every_prompt,
        [TRAIN_PROMPTS, *args.train_data],
        target.tokenizer,
        args.dedup_threshold,
        args.dedup_ngram,
    )
    if not dedup["passed"]:
        names = ", ".join(
            f"{d['heldout_id']} ~ {d['source']} ({d['jaccard']:.2f})" for d in dedup["duplicates"]
        )
        print(f"error: near duplicates of training prompts: {names}", file=sys.stderr)
        return DEDUP_EXIT
    if args.check_only:
        return 0
    runs = load_runs(target.model, args.shipped, args.heads, tree, args.context_drafts)
    if not runs:
        print("error: no heads to measure (--shipped and --heads both empty)", file=sys.stderr)
        return 1
    groups = by_category(prompts)
    settings = {
        "prompts_file": str(args.prompts),
        "prompts_sha256": file_digest(args.prompts),
        "prompts": len(prompts),
        "categories": list(groups),
        "per_category": ", ".join(f"{c} {len(g)}" for c, g in groups.items()),
        "tree": vars(tree),
        "max_new_tokens": args.max_new_tokens,
        "context_drafts": args.context_drafts,
        "draft_corpus": args.draft_corpus,
        "temperatures": args.temperatures,
        "seed": args.seed,
        "draft_sampling": args.draft_sampling,
        "ignore_eos": args.ignore_eos,
        "dtype": args.dtype,
        "mean_tau": "unweighted mean of the category τs",
    }
    machine = machine_record()
    print(
        f"cpu: {machine['cpu']}; flags: {' '.join(machine['flags'])}; kernels "
        f"{machine['kernels']}; {machine['threads']} threads"
    )
    print("settings: " + json.dumps(settings))
    rows = measure(
        target.model,
        target.tokenizer,
        runs,
        prompts,
        args.temperatures,
        args.max_new_tokens,
        args.seed,
        DraftSampling(args.draft_sampling),
        () if args.ignore_eos else None,
        resolve_corpus(args.draft_corpus, True, target.model),
    )
    report = {
        "date": time.strftime("%Y-%m-%d"),
        "machine": machine,
        "settings": settings,
        "dedup": dedup,
        "rows": rows,
        "wall_seconds": round(time.perf_counter() - started, 1),
    }
    write_report(args.out, report, markdown(report))
    if not args.no_plot and plot(report, args.out / "tau_per_category.png") is None:
        print("(no plot: matplotlib is not installed)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
