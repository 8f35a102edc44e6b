"""The data engine: prompts written by the target, deduplicated, answered by the target.

Stages, each resumable shard by shard (a shard is written atomically and skipped on a rerun
when its key, a hash of the settings and of its inputs, matches):

1. ``prompts``: the plan's openers (``selfspec.train.datagen.plan``) completed by the target
   inside an open user turn (Magpie-style), sampled; a message that does not end within
   ``max_user_tokens`` is dropped.
2. ``dedup``: near-duplicate user messages dropped (MinHash, ``dedup.py``); per-category counts.
3. ``responses``: every kept message answered by the target, greedy or sampled as planned.
4. ``followups``: for the planned share, a second user turn (Magpie again, after the first
   exchange) and its answer.

All generation runs through ``BatchDecoder`` (continuous batching, KV cache). Response rows
use the distilled-data columns (``selfspec.train.shards``), so ``OUT/responses`` and
``OUT/followups`` train heads directly; ``layer_features`` (the target's states at
``tap_layers``, the EAGLE-3 input) are a by-product written to a local cache
(``features_dir``), never next to the token ids. ``OUT/engine.json`` records the settings and,
per stage, rows, tokens and the seconds its shards took; ``OUT/README.md`` is the dataset card.
"""

from __future__ import annotations

import hashlib
import json
import logging
import random
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from tqdm import tqdm

from selfspec.atomic import write_text_atomic
from selfspec.cost_curve import cpu_flags
from selfspec.fingerprint import fingerprint_of
from selfspec.generation import eos_token_ids
from selfspec.heads.config import default_target_layers
from selfspec.sampling import SamplingParams
from selfspec.target import LoadedTarget, TargetSpec, apply_chat_template, load_target
from selfspec.train.datagen.batch_decoder import BatchDecoder, GenerationRequest, GenerationResult
from selfspec.train.datagen.card import write_record
from selfspec.train.datagen.dedup import DedupConfig, near_duplicates
from selfspec.train.datagen.features import FeatureCache
from selfspec.train.datagen.magpie import user_message, user_turn_prompt
from selfspec.train.datagen.passages import installed_passages
from selfspec.train.datagen.plan import Conversation, PlanConfig, plan
from selfspec.train.shards import (
    SHARD_META,
    DistilledDataError,
    empty_shard,
    finished_key,
    shard_dir,
    shard_key,
    write_json,
    write_rows,
    write_shard,
)

logger = logging.getLogger(__name__)
STAGES = ("prompts", "dedup", "responses", "followups")
ANSWER_STAGES = ("responses", "followups")
"""The stages whose output depends on who answers (``EngineConfig.adapters``)."""


@dataclass(frozen=True)
class EngineConfig:
    output: str
    """Directory of the run (stage shards, plan, card); an existing one is resumed."""
    target: TargetSpec = field(default_factory=TargetSpec)
    """The target, run as given when bf16 is off (or auto on a CPU without bf16 instructions)."""
    bf16: str = "auto"
    """"on": generate in bfloat16 with oneDNN's linear layers (native bf16 dot products where
    the CPU has them); "auto": on where the CPU has bf16 instructions (avx512_bf16, amx_bf16),
    else ``target`` as given; "off": ``target`` as given."""
    plan: PlanConfig = field(default_factory=PlanConfig)
    dedup: DedupConfig = field(default_factory=DedupConfig)
    batch_size: int = 32
    shard_size: int = 256
    """Conversations per shard, the unit of resumption."""
    max_user_tokens: int = 64
    max_new_tokens: int = 384
    max_prompt_tokens: int = 1024
    tap_layers: tuple[int, ...] | None = None
    """Layers whose states are kept as features, with the last hidden state after them; None:
    EAGLE-3's default low/mid/high (``default_target_layers``: 2, L//2, L-3 on SmolLM2's 30
    layers); empty: no features."""
    features_dir: str | None = None
    """Where features go; None: ``$SELFSPEC_CACHE/datagen-features/<run name>``."""
    stages: tuple[str, ...] = STAGES
    """Run only these stages (each needs the ones before it finished)."""
    round_size: int = 2048
    """Conversations per round: every stage runs over a round before the next round starts."""
    max_shards: int | None = None
    """Stop after generating this many shards in this call (chunks of a long run)."""
    adapters: tuple[str, ...] = ()
    """LoRA adapters (names under ``adapters_root``) that answer a share of the conversations
    instead of the base: tokens and features of those responses are the adapted target's
    (``answerer``). Heads trained on them learn to continue text the base would not write,
    which is where shared heads lose under an adapter (issue #20). Empty: the base answers all,
    and the run's keys are those of a run without this setting."""
    adapters_root: str | None = None
    adapter_share: float = 0.5
    """The share of conversations an adapter answers (drawn per conversation, seeded)."""

    def __post_init__(self) -> None:
        for name in ("batch_size", "shard_size", "max_user_tokens", "max_new_tokens", "round_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"datagen {name} must be >= 1, got {getattr(self, name)}")
        if self.bf16 not in ("auto", "on", "off"):
            raise ValueError(f"datagen bf16 must be auto, on or off, got {self.bf16!r}")
        if self.round_size % self.shard_size:
            raise ValueError(
                f"datagen round_size ({self.round_size}) must be a multiple of shard_size "
                f"({self.shard_size}), so that no shard spans two rounds"
            )
        if not 0.0 <= self.adapter_share <= 1.0:
            raise ValueError(f"datagen adapter_share must be in [0, 1], got {self.adapter_share}")
        if self.adapters and self.adapters_root is None:
            raise ValueError("datagen adapters need adapters_root (the directory holding them)")
        unknown = [s for s in self.stages if s not in STAGES]
        if unknown:
            raise ValueError(f"unknown stages {unknown}; the stages are {list(STAGES)}")


@dataclass
class StageReport:
    rows: int = 0
    tokens: int = 0
    seconds: float = 0.0
    shards_done: int = 0
    shards_skipped: int = 0


def resolve_target(config: EngineConfig) -> TargetSpec:
    """The generation target: bf16 on oneDNN where the CPU computes bf16 natively."""
    native = any(flag in cpu_flags() for flag in ("avx512_bf16", "amx_bf16"))
    want_bf16 = config.bf16 == "on" or (config.bf16 == "auto" and native)
    spec = config.target
    if want_bf16:
        return TargetSpec(model=spec.model, dtype="bfloat16", kernels=False, threads=spec.threads)
    return spec


class DataEngine:
    """Runs the stages of a data-engine run (see the module docstring); a rerun resumes."""

    def __init__(self, config: EngineConfig, loaded: LoadedTarget | None = None) -> None:
        self.config = config
        self.loaded = loaded or load_target(resolve_target(config))
        model = self.loaded.model
        layers = model.config.num_hidden_layers
        taps = config.tap_layers
        self.tap_layers = default_target_layers(layers) if taps is None else tuple(taps)
        self.decoder = BatchDecoder(
            model,
            batch_size=config.batch_size,
            max_prompt_tokens=config.max_prompt_tokens,
            max_new_tokens=max(config.max_new_tokens, config.max_user_tokens),
            tap_layers=(),
        )
        self.feature_decoder = (
            BatchDecoder(
                model,
                batch_size=config.batch_size,
                max_prompt_tokens=config.max_prompt_tokens,
                max_new_tokens=config.max_new_tokens,
                # the heads' layers, then the last hidden state (the teacher's logits)
                tap_layers=(*self.tap_layers, layers),
            )
            if self.tap_layers
            else self.decoder
        )
        self.out = Path(config.output)
        self.tokenizer = self.loaded.tokenizer
        self.stop_ids = _stop_ids(model, self.tokenizer)
        self.features = FeatureCache.for_run(self.out, config.features_dir, self.tap_layers)
        self.settings = {
            "target": self.loaded.name,
            "base": fingerprint_of(model).to_dict(),
            "dtype": str(model.dtype),
            "max_user_tokens": config.max_user_tokens,
            "max_new_tokens": config.max_new_tokens,
            "max_prompt_tokens": config.max_prompt_tokens,
            # What a conversation's tokens depend on beyond its own plan entry (which is in its
            # shard's key): not the plan's size, so a grown plan keeps every finished shard.
            "seed": config.plan.seed,
            "top_p": config.plan.top_p,
        }
        self.store = None
        self.answerers: dict[str, Any] | None = None
        if config.adapters:
            from selfspec.adapters.store import AdapterStore

            self.store = AdapterStore(model, root=config.adapters_root)
            # What the answers depend on: which adapters (by their weights) and how often. Not
            # the user turns of stage 1, so a run with adapters can reuse a base run's prompts.
            self.answerers = {
                "adapters": {name: _weights_digest(self.store, name) for name in config.adapters},
                "share": config.adapter_share,
            }
        self._budget = config.max_shards

    # -- the run ----------------------------------------------------------------------------

    def run(self) -> dict[str, StageReport]:
        """Every stage over the plan, a round of ``round_size`` conversations at a time (each
        round's data is complete, trainable, before the next round starts; dedup keeps the
        first of near-duplicates, so a round never changes an earlier round's decisions)."""
        conversations = self._plan()
        reports: dict[str, StageReport] = {stage: StageReport() for stage in self.config.stages}
        for end in range(
            self.config.round_size,
            len(conversations) + self.config.round_size,
            self.config.round_size,
        ):
            planned = conversations[:end]
            for stage in STAGES:
                if stage not in self.config.stages:
                    continue
                report = getattr(self, f"_stage_{stage}")(planned)
                total = reports[stage]
                for name in ("rows", "tokens", "seconds", "shards_done", "shards_skipped"):
                    setattr(total, name, getattr(total, name) + getattr(report, name))
                if self._budget is not None and self._budget <= 0:
                    self._write_record(conversations)
                    return reports
            self._write_record(conversations)
            logger.info("round of %d conversations done", len(planned))
        return reports

    def _plan(self) -> list[Conversation]:
        """The plan, from ``OUT/plan.jsonl`` when it was made with the same settings: a larger
        plan keeps every recorded conversation and plans only the new ones (on this machine's
        passages), a smaller one is the recorded prefix."""
        path = self.out / "plan.jsonl"
        settings = asdict(self.config.plan)
        size = settings.pop("conversations")
        recorded: list[Conversation] = []
        if path.is_file():
            lines = path.read_text().splitlines()
            header = json.loads(lines[0]).get("plan", {})
            header.pop("conversations", None)
            if header == json.loads(json.dumps(settings)):
                recorded = [Conversation(**json.loads(line)) for line in lines[1:]]
            else:
                logger.warning("%s was made with other plan settings: planning again", path)
        if len(recorded) >= size:
            return recorded[:size]
        conversations = recorded + plan(self.config.plan, installed_passages())[len(recorded) :]
        header = {"plan": asdict(self.config.plan)}
        lines = [json.dumps(header)] + [json.dumps(asdict(c)) for c in conversations]
        self.out.mkdir(parents=True, exist_ok=True)
        write_text_atomic(path, "\n".join(lines) + "\n")
        return conversations

    def _shards(self, stage: str, items: list[Any]) -> Iterator[tuple[int, list[Any], Path]]:
        """Shard j of every stage holds the conversations with index in [j*S, (j+1)*S) (those of
        them still in the stage): shards stay the same as the plan grows round by round."""
        groups: dict[int, list[Any]] = {}
        for item in items:
            conversation = item[0] if isinstance(item, tuple) else item
            groups.setdefault(conversation.index // self.config.shard_size, []).append(item)
        for number, shard in sorted(groups.items()):
            yield number, shard, shard_dir(self.out / stage, number)

    def _run_shards(
        self,
        stage: str,
        items: list[Any],
        key_of: Callable[[list[Any]], list[Any]],
        make: Callable[[list[Any], Path, str, tqdm], tuple[int, int]],
    ) -> StageReport:
        """Each shard of ``items`` not finished with the same key: ``make(shard, path, key,
        bar)`` writes it and returns (rows, tokens)."""
        report = StageReport()
        bar = tqdm(total=len(items), desc=stage, unit="conv")
        started = time.perf_counter()
        for _, shard, path in self._shards(stage, items):
            settings = self.settings
            if self.answerers is not None and stage in ANSWER_STAGES:
                settings = {**settings, "answerers": self.answerers}
            key = shard_key({"stage": stage, **settings}, key_of(shard))
            if finished_key(path) == key:
                report.shards_skipped += 1
                bar.update(len(shard))
                continue
            if self._budget is not None and self._budget <= 0:
                break
            rows, tokens = make(shard, path, key, bar)
            report.rows += rows
            report.tokens += tokens
            report.shards_done += 1
            if self._budget is not None:
                self._budget -= 1
            elapsed = time.perf_counter() - started
            bar.set_postfix(tok_s=f"{report.tokens / elapsed:.0f}")
        bar.close()
        report.seconds = time.perf_counter() - started
        return report

    # -- stage 1: user turns written by the target ------------------------------------------

    def _stage_prompts(self, conversations: list[Conversation]) -> StageReport:
        def make(shard: list[Conversation], path: Path, key: str, bar) -> tuple[int, int]:
            started = time.perf_counter()
            requests = [
                self._user_request(c.index, c.opener, [], self._seed(c.index, "user"))
                for c in shard
            ]
            with self._as_base():
                results = self._generate(self.decoder, [r for r in requests if r is not None], bar)
            columns: dict[str, list] = {"index": [], "category": [], "user": [], "kept": []}
            tokens = 0
            for c, request in zip(shard, requests, strict=True):
                result = results.get(str(c.index)) if request is not None else None
                text = user_message(self.tokenizer, c.opener, result)
                tokens += len(result.response) if result is not None else 0
                columns["index"].append(c.index)
                columns["category"].append(c.category)
                columns["user"].append(text or "")
                columns["kept"].append(text is not None)
            self._write(path, columns, key, started, tokens, _prompt_schema())
            return len(shard), tokens

        return self._run_shards("prompts", conversations, _plan_key, make)

    # -- stage 2: dedup ---------------------------------------------------------------------

    def _stage_dedup(self, conversations: list[Conversation]) -> StageReport:
        started = time.perf_counter()
        users = self._users(conversations)
        order = sorted(users)
        dropped = {order[i] for i in near_duplicates([users[i] for i in order], self.config.dedup)}
        category = {c.index: c.category for c in conversations}
        record = {
            "settings": asdict(self.config.dedup),
            "kept": [i for i in order if i not in dropped],
            "written": dict(Counter(category[i] for i in order)),
            "after_dedup": dict(Counter(category[i] for i in order if i not in dropped)),
            "seconds": round(time.perf_counter() - started, 2),
        }
        write_json(self.out / "dedup.json", record)
        return StageReport(rows=len(record["kept"]), seconds=record["seconds"], shards_done=1)

    # -- stage 3: responses -----------------------------------------------------------------

    def _stage_responses(self, conversations: list[Conversation]) -> StageReport:
        kept = self._kept(conversations)
        users = self._users(conversations)
        items = [(c, [{"role": "user", "content": users[c.index]}]) for c in kept]
        return self._run_shards("responses", items, _messages_key, self._answer_shard(turn=1))

    # -- stage 4: follow-ups ----------------------------------------------------------------

    def _stage_followups(self, conversations: list[Conversation]) -> StageReport:
        first = self._first_exchanges(conversations)
        items = [(c, first[c.index]) for c in conversations if c.follow_up and c.index in first]
        answer = self._answer_shard(turn=2)

        def make(shard, path: Path, key: str, bar) -> tuple[int, int]:
            started = time.perf_counter()
            requests = [
                self._user_request(c.index, c.follow_up, messages, self._seed(c.index, "user2"))
                for c, messages in shard
            ]
            with self._as_base():  # the user's turn is the base's, whoever answered before
                results = self._generate(self.decoder, [r for r in requests if r is not None], None)
            follow = []
            for (c, messages), request in zip(shard, requests, strict=True):
                result = results.get(str(c.index)) if request is not None else None
                text = user_message(self.tokenizer, c.follow_up, result)
                if text is not None:
                    follow.append((c, [*messages, {"role": "user", "content": text}]))
            rows, tokens = answer(follow, path, key, bar, started)
            return rows, tokens + sum(len(r.response) for r in results.values())

        return self._run_shards("followups", items, _messages_key, make)

    def _answer_shard(self, turn: int):
        def make(shard, path: Path, key: str, bar, started: float | None = None):
            """Answers ``shard``'s conversations and writes the shard; ``started``: when work on
            it began (its recorded seconds count from there)."""
            started = time.perf_counter() if started is None else started
            requests = []
            for c, messages in shard:
                ids = tuple(apply_chat_template(self.tokenizer, messages))
                if len(ids) > self.config.max_prompt_tokens:
                    logger.warning("conversation %d: %d prompt tokens, skipped", c.index, len(ids))
                    continue
                sampling = (
                    SamplingParams()
                    if c.temperature == 0
                    else SamplingParams(temperature=c.temperature, top_p=self.config.plan.top_p)
                )
                requests.append(
                    GenerationRequest(
                        str(c.index),
                        ids,
                        self.config.max_new_tokens,
                        sampling,
                        self._seed(c.index, f"response{turn}"),
                        self.stop_ids,
                    )
                )
            results = self._answer(requests, bar)
            category = {str(c.index): c.category for c, _ in shard}
            temperature = {str(c.index): c.temperature for c, _ in shard}
            columns: dict[str, list] = {
                name: []
                for name in (
                    "input_ids",
                    "prompt_len",
                    "response_len",
                    "finished",
                    "source_index",
                    "category",
                    "temperature",
                    "turn",
                    *(["answerer"] if self.store is not None else []),
                )
            }
            features = {}
            for request in requests:
                result = results[request.key]
                columns["input_ids"].append(list(result.prompt) + list(result.response))
                columns["prompt_len"].append(len(result.prompt))
                columns["response_len"].append(len(result.response))
                columns["finished"].append(result.finished)
                columns["source_index"].append(int(request.key))
                columns["category"].append(category[request.key])
                columns["temperature"].append(temperature[request.key])
                columns["turn"].append(turn)
                if self.store is not None:
                    columns["answerer"].append(self.answerer(int(request.key)) or "")
                if result.features is not None:
                    features[request.key] = result.features
            tokens = sum(columns["response_len"])
            if features:
                self.features.write(path.parent.name, path.name, key, features)
            extra = _response_extra(answerer=self.store is not None)
            self._write(path, columns, key, started, tokens, extra, distilled=True)
            return len(requests), tokens

        return make

    # -- helpers ----------------------------------------------------------------------------

    def answerer(self, index: int) -> str | None:
        """The adapter that answers conversation ``index`` (both its turns), None: the base.
        Drawn from the plan's seed and the index alone, so a resumed or grown run agrees."""
        if self.store is None:
            return None
        rng = random.Random(f"{self.config.plan.seed}:answerer:{index}")
        if rng.random() >= self.config.adapter_share:
            return None
        return rng.choice(self.config.adapters)

    def _as_base(self):
        """The base model active (an adapter's scope leaves its adapter active after it)."""
        return self.store.scope(None)() if self.store is not None else nullcontext()

    def _answer(self, requests: list[GenerationRequest], bar) -> dict[str, GenerationResult]:
        """Responses (with their tapped features), each request under its answerer: one batched
        generation per answerer, that adapter active."""
        groups: dict[str | None, list[GenerationRequest]] = {}
        for request in requests:
            groups.setdefault(self.answerer(int(request.key)), []).append(request)
        results: dict[str, GenerationResult] = {}
        for name, group in groups.items():
            active = self.store.scope(name)() if self.store is not None else nullcontext()
            with active:
                results.update(self._generate(self.feature_decoder, group, bar))
        return results

    def _user_request(
        self, index: int, opener: str, history: list[dict[str, str]], seed: int
    ) -> GenerationRequest | None:
        """The target continues ``opener`` in a user turn after ``history`` (None: too long)."""
        ids = user_turn_prompt(self.tokenizer, history, opener)
        if len(ids) > self.config.max_prompt_tokens:
            return None
        sampling = SamplingParams(temperature=1.0, top_p=self.config.plan.top_p)
        return GenerationRequest(
            str(index), ids, self.config.max_user_tokens, sampling, seed, self.stop_ids
        )

    def _generate(
        self, decoder: BatchDecoder, requests, bar: tqdm | None
    ) -> dict[str, GenerationResult]:
        """Results by request key; ``bar`` (when given) advances one per finished request."""
        results = {}
        for result in decoder.generate(requests):
            results[result.key] = result
            if bar is not None:
                bar.update(1)
        return results

    def _seed(self, index: int, purpose: str) -> int:
        return int.from_bytes(
            shard_key({"seed": self.config.plan.seed}, [index, purpose]).encode()[:8], "little"
        )

    def _write(
        self, path: Path, columns, key: str, started: float, tokens: int, schema, distilled=False
    ):
        meta = {
            "key": key,
            "rows": len(next(iter(columns.values()))),
            "generated_tokens": tokens,
            "seconds": round(time.perf_counter() - started, 2),
        }
        if "answerer" in columns:  # rows per answerer, "(base)" for the base
            meta["answered_by"] = dict(Counter(name or "(base)" for name in columns["answerer"]))
        if distilled:
            write_shard(path, columns, meta, extra=schema)
        else:
            write_rows(path, columns, meta, schema)

    def _users(self, conversations: list[Conversation]) -> dict[int, str]:
        """Kept user messages of stage 1 by conversation index; every shard must be finished."""
        users: dict[int, str] = {}
        for _, _, path in self._shards("prompts", conversations):
            data = _read(path, "prompts")
            for index, text, kept in zip(data["index"], data["user"], data["kept"], strict=True):
                if kept:
                    users[int(index)] = text
        return users

    def _kept(self, conversations: list[Conversation]) -> list[Conversation]:
        path = self.out / "dedup.json"
        try:
            kept = set(json.loads(path.read_text())["kept"])
        except (OSError, json.JSONDecodeError, KeyError) as error:
            raise DistilledDataError(
                f"{path} is missing or malformed ({error}); run the dedup stage"
            ) from error
        return [c for c in conversations if c.index in kept]

    def _first_exchanges(self, conversations) -> dict[int, list[dict[str, str]]]:
        """Finished first exchanges (user, assistant) by conversation index."""
        out: dict[int, list[dict[str, str]]] = {}
        users = self._users(conversations)
        for path in sorted((self.out / "responses").glob("shard-*")):
            if empty_shard(path):
                continue
            data = _read(path, "responses")
            for ids, prompt_len, finished, index in zip(
                data["input_ids"],
                data["prompt_len"],
                data["finished"],
                data["source_index"],
                strict=True,
            ):
                if finished and int(index) in users:
                    answer = self.tokenizer.decode(ids[prompt_len:], skip_special_tokens=True)
                    out[int(index)] = [
                        {"role": "user", "content": users[int(index)]},
                        {"role": "assistant", "content": answer.strip()},
                    ]
        return out

    def _write_record(self, conversations: list[Conversation]) -> None:
        record = {
            "settings": self.settings
            if self.answerers is None
            else {**self.settings, "answerers": self.answerers},
            "cpu_flags": cpu_flags(),
            "batch_size": self.config.batch_size,
            "tap_layers": list(self.tap_layers),
            "features_dir": str(self.features.root),
        }
        if self.store is not None:
            record["answered_by"] = self._answered_by()
        write_record(self.out, record, len(conversations))

    def _answered_by(self) -> dict[str, int]:
        """Finished response rows (both turns) per answerer, from the shards' own records."""
        counts: Counter[str] = Counter()
        for stage in ("responses", "followups"):
            for path in sorted((self.out / stage).glob("shard-*")):
                if finished_key(path) is not None:
                    counts.update(
                        json.loads((path / SHARD_META).read_text()).get("answered_by", {})
                    )
        return dict(sorted(counts.items()))


def _prompt_schema() -> dict[str, Any]:
    from datasets import Value

    return {
        "index": Value("int64"),
        "category": Value("string"),
        "user": Value("string"),
        "kept": Value("bool"),
    }


def _response_extra(answerer: bool = False) -> dict[str, Any]:
    """Columns of a response row beyond the distilled ones (``answerer``: the adapter that
    answered, "" for the base, in runs with adapters)."""
    from datasets import Value

    extra = {"category": Value("string"), "temperature": Value("float32"), "turn": Value("int8")}
    return {**extra, "answerer": Value("string")} if answerer else extra


def _plan_key(shard: list[Conversation]) -> list[Any]:
    return [asdict(c) for c in shard]


def _messages_key(shard) -> list[Any]:
    return [[asdict(c), messages] for c, messages in shard]


def _read(path: Path, stage: str):
    from datasets import load_from_disk

    if finished_key(path) is None:
        raise DistilledDataError(
            f"{stage} shard {path} is not finished: run the {stage} stage first"
        )
    try:
        return load_from_disk(str(path))
    except (FileNotFoundError, ValueError, OSError) as error:
        raise DistilledDataError(
            f"{stage} shard {path} is not a readable dataset: {error}"
        ) from error


def _weights_digest(store, name: str) -> str:
    """A known adapter's weights file, hashed (an unknown name: the store's error naming it)."""
    path = store.info(store.resolve(name)).path / "adapter_model.safetensors"
    return hashlib.sha256(path.read_bytes()).hexdigest()[:16]


def _stop_ids(model, tokenizer) -> tuple[int, ...]:
    ids = eos_token_ids(model, tokenizer)
    if not ids:
        raise ValueError("the target has no EOS token id; the data engine needs one to end turns")
    return ids
