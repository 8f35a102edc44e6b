"""The decoding loop: prefill, then draft -> one tree forward -> verify -> commit, streamed.

The same loop runs vanilla decoding (a tree of just the root), so baselines and equality tests
go through the very code that speculates.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from enum import Enum
from typing import Any, TypeVar

import torch
from torch import nn
from torch.profiler import record_function
from transformers import DynamicCache, PreTrainedModel

from selfspec.cost_curve import CostCurve, elapsed_seconds
from selfspec.drafting import AdvanceRequest, Drafter, DraftPlan, DraftRequest, make_drafter
from selfspec.drafting.context import ContextChain, ContextDrafts, ContextIndex
from selfspec.drafting.corpus import DraftCorpus
from selfspec.drafting.grow import context_tree
from selfspec.drafting.head_kernels import heads_on_kernels
from selfspec.drafting.sizing import TreeSizer
from selfspec.drafting.taps import LayerTaps, maybe_capture, taps_for
from selfspec.growing_cache import is_full_attention
from selfspec.heads.medusa import MedusaHeads
from selfspec.kv_commit import commit_accepted
from selfspec.logprobs import MAX_TOP_LOGPROBS, TokenLogprob, token_logprobs
from selfspec.prefill import PrefillChunk, PrefillProgress, run_prefill_chunk
from selfspec.prefix_cache import CachedPrefix, PrefixCache
from selfspec.sampling import SamplingParams, greedy_tokens, sample_from, warp_probs
from selfspec.speculation_gate import SpeculationGate
from selfspec.stats import GenerationStats, StepRecord
from selfspec.target_forward import TargetForward
from selfspec.tree import (
    ADAPTIVE_TREE,
    DraftSampling,
    DynamicTree,
    Tree,
    TreeBuffers,
    TreeSpec,
    prune,
    tree_buffers,
)
from selfspec.verify import verify_greedy, verify_sampling

COST_SCALE_DECAY = 0.8
"""Weight of the past in a request's verification-cost scale (about the last five steps count)."""

StepScope = Callable[[], contextlib.AbstractContextManager]
"""Makes a context entered around every step of one request (e.g. activating its adapter)."""

Rows = TypeVar("Rows")
"""A tensor or a numpy array of rows (``split_recorded`` slices either)."""


@dataclass(frozen=True)
class GenerationConfig:
    max_new_tokens: int = 256
    sampling: SamplingParams = SamplingParams()
    seed: int | None = None
    """Seeds the request's own generator; the same seed gives the same output."""
    stop_strings: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] | None = None
    """None: the tokenizer's / model's EOS ids."""
    speculate: bool = True
    """False: vanilla decoding through the same loop (needs no heads)."""
    tree: TreeSpec | None = None
    """None: the generator's default (``SpeculativeGenerator.tree_for``)."""
    draft_sampling: DraftSampling = DraftSampling.WITHOUT_REPLACEMENT
    """How children are drawn when sampling (``DraftSampling``; greedy ignores it)."""
    context_drafts: ContextDrafts | None = ContextDrafts()
    """Also graft chains into each tree: one copied from the request's own context (prompt and
    output so far), one retrieved from the generator's draft corpus where it has one
    (``selfspec.drafting.context``); offered even in steps whose heads do not draft. None: the
    heads' drafts alone."""
    logprobs: int | None = None
    """None: no log-probabilities; k >= 0: each generated token's, with its k best alternatives
    (``selfspec.logprobs``)."""
    prompt_logprobs: bool = False
    """Also score the prompt's tokens (each under the positions before it; the first has none).
    Costs the lm_head over the whole prompt (and bypasses the prefix cache)."""
    prefix_namespace: str | None = None
    """With the generator's ``prefix_cache``: the namespace (the request's adapter, or the base
    model's name) whose cached prompt prefixes this request may reuse and extend; None: none."""
    record_features: bool = False
    """Keep the target's last hidden state at every position of prompt and output (float16, on
    the CPU) and return them as ``GenerationResult.features``: a drafter's training rows for
    this request's adapter, as a by-product of serving it (``selfspec.serve.recalibration``).
    For heads that read tapped layers (EAGLE-3) each position keeps those states too, before the
    last hidden state. Speculating requests only."""

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(
                f"logprobs must be None or in [0, {MAX_TOP_LOGPROBS}], got {self.logprobs}"
            )
        if any(not s for s in self.stop_strings):
            raise ValueError("stop strings must be non-empty")
        object.__setattr__(self, "stop_strings", tuple(self.stop_strings))
        object.__setattr__(self, "draft_sampling", DraftSampling(self.draft_sampling))
        if self.context_drafts is not None and not isinstance(self.context_drafts, ContextDrafts):
            raise TypeError(
                f"context_drafts must be a ContextDrafts or None, got {self.context_drafts!r}"
            )


class FinishReason(str, Enum):
    STOP = "stop"
    """EOS or a stop string."""
    LENGTH = "length"
    """max_new_tokens reached."""


@dataclass
class StepOutput:
    token_ids: list[int]
    """Tokens committed by this step (after stop truncation)."""
    text: str
    """Text delta for these tokens ("" without a tokenizer)."""
    logprobs: list[TokenLogprob] | None = None
    """One per token of ``token_ids`` when the request asked for log-probabilities."""
    prompt_logprobs: list[TokenLogprob | None] | None = None
    """The first output only, when asked for: one per prompt token (None for the first)."""


@dataclass
class GenerationResult:
    token_ids: list[int]
    text: str
    finish_reason: FinishReason
    stats: GenerationStats
    logprobs: list[TokenLogprob] | None = None
    """One per generated token, when asked for."""
    prompt_logprobs: list[TokenLogprob | None] | None = None
    """One per prompt token (None for the first), when asked for."""
    features: torch.Tensor | None = None
    """With ``GenerationConfig.record_features``: the target's last hidden state at each
    position of prompt + ``token_ids`` but the last, the features a drafter reads there.
    # [S + N - 1, H] float16; for heads reading tapped layers (EAGLE-3) # [S + N - 1, k*H + H]:
    the states entering their k layers, then the last hidden state (``split_recorded``)."""

    def to_dict(self) -> dict[str, Any]:
        return {
            "text": self.text,
            "token_ids": self.token_ids,
            "finish_reason": self.finish_reason.value,
            "stats": self.stats.to_dict(),
        }


@dataclass
class RequestState:
    """Everything one request's steps read and write."""

    cache: DynamicCache
    generator: torch.Generator
    committed_len: int
    root_token: int
    draft_state: Any = None
    """The drafter's state; None until the request first drafts (see ``deferred_start``)."""
    deferred_start: tuple[torch.Tensor, torch.Tensor] | None = None
    """The prompt's (features # [S, F], tokens # [S]) while the draft state is not built yet:
    ``_catch_up`` starts the drafter on them (and on the steps committed since) when the request
    first drafts."""
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    streamed_chars: int = 0
    """How much of ``text`` the stream has handed out."""
    finish_reason: FinishReason | None = None
    stats: GenerationStats = field(default_factory=GenerationStats)
    drafts_accepted: float = 1.0
    drafts_predicted: float = 1.0
    """Running sums (one pseudo-count each) calibrating the draft's confidence for tree sizing."""
    cost_scale: float = 1.0
    """Moving average of measured / curve verification seconds, for tree sizing."""
    overhead_seconds: float = 0.0
    """Moving average of a step's work after its forward (verdict, KV commit, head advance),
    for tree sizing."""
    drafting_seconds: float = 0.0
    """Moving average of the drafting time of this request's drafted steps, for tree sizing."""
    taps: LayerTaps | None = None
    """The target layers this request's drafter reads besides the last hidden state (EAGLE-3),
    tapped during every forward of the request; None for Medusa and EAGLE."""
    draft_features: torch.Tensor | None = None
    """With taps: the tapped states of the last verification forward's tree # [T, k * H], set
    by that forward (``verify``, ``selfspec.batched_verify``) and taken by ``conclude``."""
    logprobs: list[TokenLogprob] | None = None
    """With ``GenerationConfig.logprobs``: the committed tokens' log-probabilities."""
    step_logprobs: list[TokenLogprob] = field(default_factory=list)
    """Those of the tokens the last prefill / step chose, until the stream commits them."""
    prompt_logprobs: list[TokenLogprob | None] | None = None
    """With ``GenerationConfig.prompt_logprobs``: the prompt's, None for its first token."""
    deferred_advance: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    """Steps committed without drafting (the server's speculation gate said no), not yet given
    to the drafter: each one's (features # [A, F], tokens # [A]) of the accepted path, root
    first. The next drafting step advances the draft state over all of them in one call."""
    recorded_features: list[torch.Tensor] | None = None
    """With ``GenerationConfig.record_features``: the last hidden states (after the tapped
    layers' states, with taps) of every committed position so far, in order (the prompt's, then
    each step's accepted path) # [n_i, H] or [n_i, k*H + H] fp16."""
    context: ContextIndex | None = None
    """With ``GenerationConfig.context_drafts`` in a speculating request: the prompt and the
    committed tokens, indexed for context drafts."""

    @property
    def calibration(self) -> float:
        return self.drafts_accepted / self.drafts_predicted


@dataclass(frozen=True)
class DraftedStep:
    """A step between drafting and verification: the tree and what its forward needs."""

    tree: Tree
    buffers: TreeBuffers
    drafted: bool = True
    """False: the root alone because this step did not speculate (``draft(speculate=False)``);
    its conclusion then defers the draft state's advance to the next step that drafts."""
    sizer: TreeSizer | None = None
    """Set when the tree's size is left to the caller (``draft(joint=True)``): how this
    request prices its nodes, for ``sizing.joint_keep``; then ``resize``."""
    drafting_seconds: float = 0.0
    """What drafting this tree took (joint sizing counts it in the round's time)."""
    horizon: int = 0
    """With ``sizer``: the most nodes the tree may keep (its spec's budget)."""
    context: tuple[ContextChain, ...] = ()
    """The context chains offered to this tree (kept in it or not), observed at ``conclude``."""


@dataclass(frozen=True)
class StepToDraft:
    """One request's next step for ``SpeculativeGenerator.draft_many`` (see ``draft``)."""

    state: RequestState
    config: GenerationConfig
    speculate: bool = True
    joint: bool = False


MAX_DEFERRED_TOKENS = 64
"""Committed tokens a request's draft state may lag behind before it catches up anyway."""


class SpeculativeGenerator:
    """Generates from a target (optionally peft-wrapped) with draft heads.

    Holds references only; every request gets its own RequestState. ``cost_curve`` (this
    machine's verification cost per tree size, see ``selfspec.cost_curve``) enables adaptive
    trees, the default tree when it is given. ``lean_body=False`` runs the target's decoder body
    through transformers even where ``selfspec.lean_body`` covers it (same results, slower).
    """

    def __init__(
        self,
        model: PreTrainedModel,
        heads: nn.Module | None = None,
        tokenizer: Any = None,
        cost_curve: CostCurve | None = None,
        lean_body: bool = True,
    ) -> None:
        self.target = TargetForward(model, lean=lean_body)
        self.cost_curve = cost_curve
        self.heads = heads
        self.drafter: Drafter | None = (
            make_drafter(heads, self.target) if heads is not None else None
        )
        if heads is not None:
            heads_on_kernels(self.drafter, heads, model)  # drafting's small-M linears
        self.taps = taps_for(self.drafter, self.target.body)  # EAGLE-3's layers, else None
        self.tokenizer = tokenizer
        self.context_limit = _context_limit(model)
        self.default_stop_ids = eos_token_ids(model, tokenizer)
        self.gate = SpeculationGate() if cost_curve is not None else None
        """Whether a step of an adaptive request drafts at all, from the committed tokens per
        second measured with and without drafting (``GenerationStream.step``): the per-step
        cost of drafting (heads calls, tree bookkeeping) can exceed what a small tree saves,
        which the tree sizer, pricing nodes after drafting, cannot see. A server gates its
        rounds itself (``selfspec.serve.engine``)."""
        self.corpus: DraftCorpus | None = None
        """Set by a caller: the target's past responses, which context drafts also retrieve
        chains from (``selfspec.drafting.corpus``, ``ContextDrafts.corpus``)."""
        self.prefix_cache: PrefixCache | None = None
        """Set by a server: prompt prefixes reused across requests (``GenerationConfig.
        prefix_namespace``); only exact where the target's rows are computed row-invariantly
        (``prefix_cache_exact``)."""

    @property
    def prefix_cache_exact(self) -> bool:
        """Whether a prefill over cached prefix entries gives the same bits as a full one: the
        target runs on the row-invariant kernels (fixed-order attention)."""
        lean = self.target.lean
        return lean is not None and lean.fixed_order

    def generate(
        self, prompt_ids: Sequence[int], config: GenerationConfig, scope: StepScope | None = None
    ) -> GenerationResult:
        stream = self.stream(prompt_ids, config, scope)
        for _ in stream:
            pass
        return stream.result

    def stream(
        self, prompt_ids: Sequence[int], config: GenerationConfig, scope: StepScope | None = None
    ) -> GenerationStream:
        """Start a request. ``scope`` is entered around each of its steps (prefill included):
        the adapters wing uses it to make the request's adapter the active one, so requests on
        different adapters can be interleaved step by step."""
        self._validate(prompt_ids, config)
        return GenerationStream(self, list(prompt_ids), config, scope or contextlib.nullcontext)

    def _validate(self, prompt_ids: Sequence[int], config: GenerationConfig) -> None:
        if len(prompt_ids) == 0:
            raise ValueError("the prompt is empty: at least one token is needed")
        vocab = self.target.vocab_size
        bad = [t for t in prompt_ids if not 0 <= int(t) < vocab]
        if bad:
            raise ValueError(f"prompt token ids out of range [0, {vocab}): {bad[:5]}")
        if config.speculate and self.drafter is None:
            raise ValueError("speculation needs heads: pass heads, or set speculate=False")
        if config.stop_strings and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer")
        tree = self.tree_for(config)
        adaptive = isinstance(tree, DynamicTree) and tree.adaptive
        if config.speculate and adaptive and self.cost_curve is None:
            raise ValueError(
                "an adaptive tree needs the generator's cost curve "
                "(SpeculativeGenerator(..., cost_curve=cached_cost_curve(...)))"
            )
        depth = tree.depth if config.speculate else 0
        if (
            config.speculate
            and isinstance(self.heads, MedusaHeads)
            and depth > self.heads.config.num_heads
        ):
            raise ValueError(
                f"tree depth {depth} exceeds the {self.heads.config.num_heads} Medusa heads"
            )
        needed = len(prompt_ids) + config.max_new_tokens + depth
        if self.context_limit is not None and needed > self.context_limit:
            raise ValueError(
                f"prompt ({len(prompt_ids)} tokens) + max_new_tokens ({config.max_new_tokens}) "
                f"+ tree depth ({depth}) = {needed} exceeds the model's context of "
                f"{self.context_limit}"
            )

    def tree_for(self, config: GenerationConfig) -> TreeSpec:
        """The request's tree, else the default: adaptive with a cost curve, else fixed."""
        if config.tree is not None:
            return config.tree
        tree = ADAPTIVE_TREE if self.cost_curve is not None else DynamicTree()
        if isinstance(self.heads, MedusaHeads):  # one head per depth
            return replace(tree, depth=min(tree.depth, self.heads.config.num_heads))
        return tree

    # -- the steps ---------------------------------------------------------------------------

    def prefill(self, prompt: torch.Tensor, config: GenerationConfig) -> RequestState:
        """prompt: # [S] -> state with the first token chosen and the cache filled."""
        state = self.prefill_chunk(self.begin_prefill(prompt, config), config, None)
        assert state is not None  # no chunk limit: the whole prompt
        return state

    @property
    def prefill_chunks_exact(self) -> bool:
        """Whether a prompt prefilled in chunks gives the same bits as in one forward: the
        target's rows are computed row-invariantly (as for the prefix cache)."""
        return self.prefix_cache_exact

    def begin_prefill(self, prompt: torch.Tensor, config: GenerationConfig) -> PrefillProgress:
        """A prefill of ``prompt`` # [S] to run with ``prefill_chunk``: its generator seeded, a
        cached prefix of the prompt (if any) already in its cache."""
        device = self.target.device
        generator = torch.Generator(device=device)
        if config.seed is None:
            generator.seed()  # fresh entropy for this generator only; the global RNG is untouched
        else:
            generator.manual_seed(config.seed)
        cache = self.target.new_cache()
        reuse = self._cached_prefix(prompt, config, cache)  # fills the cache's first entries
        return PrefillProgress(
            prompt=prompt,
            cache=cache,
            generator=generator,
            taps=self.taps if config.speculate else None,
            reuse=reuse,
            done=0 if reuse is None else reuse.length,
        )

    def prefill_chunk(
        self, progress: PrefillProgress, config: GenerationConfig, max_tokens: int | None
    ) -> RequestState | None:
        """Run up to ``max_tokens`` more prompt tokens (None: the rest; the rest anyway where
        chunks would not be exact, see ``prefill_chunks_exact``) in a forward of their own.
        Returns the request's state once the prompt is done (its first token chosen), else
        None."""
        chunk = self.next_prefill_chunk(progress, max_tokens)
        features, tapped = run_prefill_chunk(self.target, progress, chunk)
        return self.absorb_prefill_chunk(progress, config, chunk, features, tapped)

    def next_prefill_chunk(self, progress: PrefillProgress, max_tokens: int | None) -> PrefillChunk:
        """The prompt tokens the next chunk runs: up to ``max_tokens`` more (None: the rest;
        the rest anyway where chunks would not be exact, see ``prefill_chunks_exact``)."""
        prompt, start = progress.prompt, progress.done
        length = int(prompt.shape[0])
        end = length
        if max_tokens is not None and self.prefill_chunks_exact:
            end = min(length, start + max(1, max_tokens))
        return PrefillChunk(
            tokens=prompt[start:end],
            positions=torch.arange(start, end, device=self.target.device),
            mask=None if start == 0 else after_prefix_mask(start, end, self.target),
            end=end,
        )

    def absorb_prefill_chunk(
        self,
        progress: PrefillProgress,
        config: GenerationConfig,
        chunk: PrefillChunk,
        features: torch.Tensor,  # [n, H]
        tapped: torch.Tensor | None,  # [n, k * H]
    ) -> RequestState | None:
        """Take a chunk's forward (its own, or a server round's shared one) into the prefill.
        Returns the request's state once the prompt is done (its first token chosen), else
        None."""
        progress.features.append(features)
        if tapped is not None:
            progress.tapped.append(tapped)
        progress.done = chunk.end
        if chunk.end != int(progress.prompt.shape[0]):
            return None
        return self._finish_prefill(progress, config)

    def _finish_prefill(self, progress: PrefillProgress, config: GenerationConfig) -> RequestState:
        """The whole prompt is in the cache: choose the first token, store the prefix, keep what
        the drafter starts from when the request first drafts."""
        prompt, cache, reuse = progress.prompt, progress.cache, progress.reuse
        features = torch.cat(progress.features)  # [S - reused, H]
        with record_function("selfspec.prefill"):
            logits = self.target.logits(features[-1])  # [vocab]
        tapped = None if progress.taps is None else torch.cat(progress.tapped)  # [S - reused, kH]
        # What the drafter reads: the last hidden states, or the tapped layers # [S, F]
        draft_features = features if tapped is None else tapped
        if reuse is not None and reuse.features is not None:
            draft_features = torch.cat([reuse.features, draft_features])
        namespace = self._prefix_namespace(config, cache)
        if namespace is not None:
            stored = draft_features if config.speculate else None
            self.prefix_cache.insert(namespace, prompt.tolist(), cache, stored)
        first = _choose(logits, config.sampling, progress.generator)
        state = RequestState(
            cache=cache,
            generator=progress.generator,
            committed_len=prompt.shape[0],
            root_token=first,
            taps=progress.taps,
        )
        if config.speculate and config.context_drafts is not None:
            state.context = ContextIndex(
                config.context_drafts, [*prompt.tolist(), first], self.corpus
            )
        if config.logprobs is not None:
            state.logprobs = []
            chosen = torch.tensor([first], device=logits.device)
            state.step_logprobs = token_logprobs(logits[None], chosen, config.logprobs)
            if config.prompt_logprobs:
                with record_function("selfspec.prompt_logprobs"):
                    rows = self.target.logits(features[:-1])  # [S-1, vocab]
                    scored = token_logprobs(rows, prompt[1:], config.logprobs)
                state.prompt_logprobs = [None, *scored]
        if config.speculate:
            # The draft state is built when the request first drafts (``_catch_up``): a request
            # whose rounds never draft (the server's gate under load) never pays for it.
            state.deferred_start = (draft_features, prompt)
            if config.record_features:
                # With taps, a reused prefix kept only its tapped states: such a request's rows
                # come out short and are not returned (``_recorded_rows``).
                last = draft_features if tapped is None else features  # [S (- reused), H]
                state.recorded_features = [_recorded(last, tapped)]
        return state

    def _cached_prefix(
        self, prompt: torch.Tensor, config: GenerationConfig, cache: DynamicCache
    ) -> CachedPrefix | None:
        """The cached entries of the prompt's longest known prefix, copied into ``cache``."""
        namespace = self._prefix_namespace(config, cache)
        if namespace is None or config.prompt_logprobs:  # prompt scores need every row
            return None
        reuse = self.prefix_cache.lookup(namespace, prompt.tolist(), features=config.speculate)
        if reuse is not None:
            for index, (keys, values) in enumerate(zip(reuse.keys, reuse.values, strict=True)):
                cache.update(keys, values, index)
        return reuse

    def _prefix_namespace(self, config: GenerationConfig, cache: DynamicCache) -> str | None:
        """The prefix cache's namespace for this request: its adapter, and what the drafter
        reads (the last hidden state or the tapped layers); None when it cannot reuse prefixes
        (no cache or namespace, or a cache of other layer kinds, e.g. sliding windows)."""
        if self.prefix_cache is None or config.prefix_namespace is None:
            return None
        if not all(map(is_full_attention, cache.layers)):
            return None
        reads = "last" if self.taps is None else "taps" + ",".join(map(str, self.taps.layers))
        return f"{config.prefix_namespace}\x00{reads}"

    def draft(
        self,
        state: RequestState,
        config: GenerationConfig,
        batch_size: int = 1,
        speculate: bool = True,
        joint: bool = False,
    ) -> DraftedStep:
        """The tree this step verifies (the root alone without speculation), with its buffers.
        batch_size: requests whose trees the verification forward will hold (adaptive sizing
        prices this tree by its share of that forward). speculate False: the heads do not draft
        this step even in a speculating request (the draft state still advances in
        ``conclude``, as after a step whose drafts were all rejected); alone (``batch_size``
        1) its context chains are still offered, since they cost no drafting and are sized like
        any tree, in a batch the root alone. joint: an adaptive tree keeps every node it
        drafted (up to its budget) and the step carries its sizer, so the caller sizes the
        batch's trees together (``sizing.joint_keep``, then ``resize``)."""
        return self.draft_many([StepToDraft(state, config, speculate, joint)], batch_size)[0]

    def draft_many(self, steps: Sequence[StepToDraft], batch_size: int) -> list[DraftedStep]:
        """Each step's tree as ``draft`` gives it, the speculating ones drafted together in one
        batched call of the heads (``Drafter.draft_many``); each is priced with its share of
        the drafting time. The caller runs them under one scope (the same adapter)."""
        speculating = [step.config.speculate and step.speculate for step in steps]
        self._catch_up([step.state for step, own in zip(steps, speculating, strict=True) if own])
        # Each step's context chains, () for none. A step the gate keeps plain offers them only
        # when it runs alone: in a batch they would pad every row, rarely pay (16 requests: 2 of
        # 95 plain rounds kept a chain node) and cost each request its proposal every round.
        chains = [
            step.state.context.propose()
            if step.state.context is not None and (own or batch_size == 1)
            else ()
            for step, own in zip(steps, speculating, strict=True)
        ]
        plans = [  # None: the heads do not draft this step
            self._plan(step, batch_size, chain) if own else None
            for step, own, chain in zip(steps, speculating, chains, strict=True)
        ]
        requests = [
            DraftRequest(step.state.draft_state, step.state.root_token, plan, step.state.generator)
            for step, plan in zip(steps, plans, strict=True)
            if plan is not None
        ]
        trees: list[Tree] = []
        drafting = 0.0
        if requests:
            started = time.perf_counter()
            with record_function("selfspec.draft"):
                trees = self.drafter.draft_many(requests)
            drafting = (time.perf_counter() - started) / len(requests)
        drafted_trees = iter(trees)
        out = []
        for step, plan, chain in zip(steps, plans, chains, strict=True):
            sizing = plan
            if plan is not None:
                tree = next(drafted_trees)
                step.state.drafting_seconds = _moving_average(step.state.drafting_seconds, drafting)
            elif chain:  # the heads rest, the context chains are still offered (alone)
                sizing = self._plan(step, batch_size, chain)
                tree = context_tree(step.state.root_token, sizing, self.target.device)
            else:
                tree = _root_only(step.state.root_token, self.target.device)
            with record_function("selfspec.tree_buffers"):
                buffers = tree_buffers(tree, step.state.committed_len, self.target.dtype)
            out.append(
                DraftedStep(
                    tree,
                    buffers,
                    drafted=plan is not None,
                    sizer=sizing.sizer if sizing is not None and sizing.defer_keep else None,
                    horizon=getattr(sizing.tree, "budget", 0) if sizing is not None else 0,
                    drafting_seconds=0.0 if plan is None else drafting,
                    context=chain,
                )
            )
        return out

    def _plan(
        self, step: StepToDraft, batch_size: int, context: tuple[ContextChain, ...]
    ) -> DraftPlan:
        """How ``step`` drafts, ``context`` grafted in; with ``joint`` and an adaptive tree,
        ``defer_keep``: the caller sizes the tree."""
        state, config = step.state, step.config
        sizer = (
            TreeSizer(
                self.cost_curve,
                state.calibration,
                state.cost_scale,
                batch_size,
                state.overhead_seconds,
                state.drafting_seconds,
            )
            if self.cost_curve is not None
            else None
        )
        spec = self.tree_for(config)
        return DraftPlan(
            tree=spec,
            sampling=config.draft_sampling,
            params=config.sampling,
            sizer=sizer,
            defer_keep=step.joint and sizer is not None and getattr(spec, "adaptive", False),
            context=context,
        )

    def resize(
        self, state: RequestState, drafted: DraftedStep, count: int, as_drawn: bool = False
    ) -> DraftedStep:
        """``drafted`` keeping its ``count`` best drafted nodes (``tree.prune``; ``as_drawn``:
        the count came from ``joint_keep(as_drawn=True)``), with its buffers remade; itself
        when it has no more."""
        tree = prune(drafted.tree, count, as_drawn)
        if tree is drafted.tree:
            return drafted
        with record_function("selfspec.tree_buffers"):
            buffers = tree_buffers(tree, state.committed_len, self.target.dtype)
        return replace(drafted, tree=tree, buffers=buffers)

    def _catch_up(self, states: Sequence[RequestState]) -> None:
        """Bring each state's draft state up to its committed tokens: a state not built yet is
        started on its prompt and the steps since; the others advance over the steps committed
        without advancing them (plain rounds of the server's gate, or advances deferred by a
        batched conclude), all in one drafter call. The pairs appended are those an eager start
        and each step's own advance would have appended, in order (each step's root is the
        bonus token of the one before)."""
        for state in states:
            if state.deferred_start is not None:  # the prompt, then the steps since, at once
                features, tokens = state.deferred_start
                paths = state.deferred_advance
                features = torch.cat([features, *(f for f, _ in paths)])  # [S + sum A, F]
                tokens = torch.cat([tokens, *(t for _, t in paths)])  # [S + sum A]
                state.deferred_start, state.deferred_advance = None, []
                with record_function("selfspec.draft_prefill"):
                    state.draft_state = self.drafter.start(features, tokens, state.root_token)
        behind = [state for state in states if state.deferred_advance]
        if not behind:
            return
        requests = []
        for state in behind:
            features = torch.cat([f for f, _ in state.deferred_advance])  # [sum A, F]
            tokens = torch.cat([t for _, t in state.deferred_advance])  # [sum A]
            state.deferred_advance.clear()
            requests.append(AdvanceRequest(state.draft_state, features, tokens, state.root_token))
        with record_function("selfspec.draft_advance"):
            self.drafter.advance_many(requests)

    def step(self, state: RequestState, config: GenerationConfig) -> list[int]:
        """Draft, verify in one target forward, commit. Returns the newly committed tokens.

        Each phase runs under a ``torch.profiler.record_function`` label ("selfspec.draft",
        "selfspec.verify_forward", ...), so a profile says where a step's time goes
        (benchmarks/profile_step.py); the labels cost nothing measurable when no profiler runs."""
        return self.verify(state, config, self.draft(state, config))

    def verify(
        self, state: RequestState, config: GenerationConfig, drafted: DraftedStep
    ) -> list[int]:
        """Verify a drafted tree in a target forward of its own, then ``conclude``."""
        tree, buffers = drafted.tree, drafted.buffers
        started = time.perf_counter()
        with record_function("selfspec.verify_forward"), maybe_capture(state.taps) as tapped:
            features = self.target.features(
                tree.tokens[None], buffers.position_ids, state.cache, buffers.attention_mask
            )[0]  # [T, H]
        if tapped is not None:
            state.draft_features = tapped.stacked()[0]  # [T, k * H]
        with record_function("selfspec.verify_lm_head"):
            logits = self.target.logits(features)  # [T, vocab]
        self.observe_verification(state, elapsed_seconds(started, logits.device), tree.size)
        return self.conclude(state, config, drafted, features, logits)

    def observe_verification(self, state: RequestState, seconds: float, tokens: int) -> None:
        """Fold one timed verification (body + lm_head over ``tokens`` tree tokens, what the cost
        curve times) into the request's cost scale, so tree sizing follows the current load.
        In a batched forward, ``tokens`` counts every tree's rows the forward computed (padding
        included where the trees were padded: ``VerifiedRows.forward_tokens``)."""
        if self.cost_curve is None:
            return
        measured = seconds / self.cost_curve.at(tokens)
        state.cost_scale = _moving_average(state.cost_scale, measured)

    def conclude(
        self,
        state: RequestState,
        config: GenerationConfig,
        drafted: DraftedStep,
        features: torch.Tensor,  # [T, H]: the tree's target features, its KV entries cached
        logits: torch.Tensor | None = None,  # [T, vocab]: the lm_head's, if already computed
        defer_advance: bool = False,
    ) -> list[int]:
        """Verify a drafted tree from its features, commit the accepted path to the KV cache and
        the draft state. Returns the newly committed tokens (accepted drafts, then the bonus).
        ``defer_advance``: the draft state catches up at the next step that drafts instead (a
        batch's requests then advance in one drafter call, ``draft_many``)."""
        tree = drafted.tree
        if logits is None:
            with record_function("selfspec.verify_lm_head"):
                logits = self.target.logits(features)  # [T, vocab]
        started = time.perf_counter()
        with record_function("selfspec.verify"):
            if config.sampling.greedy:
                verdict = verify_greedy(tree, drafted.buffers.ancestors, logits)
            else:
                verdict = verify_sampling(tree, logits, config.sampling, state.generator)
        with record_function("selfspec.commit"):
            commit_accepted(state.cache, state.committed_len, verdict.accepted)
            state.committed_len += int(verdict.accepted.shape[0])
            accepted_tokens = tree.tokens[verdict.accepted]  # [A], root first
        if config.speculate:
            draft_features = features if state.taps is None else _take_draft_features(state)
            if state.recorded_features is not None:
                tapped = None if state.taps is None else draft_features[verdict.accepted]
                state.recorded_features.append(_recorded(features[verdict.accepted], tapped))
            path_features = draft_features[verdict.accepted]  # [A, F]
            if drafted.drafted and not defer_advance:
                with record_function("selfspec.draft_advance"):
                    self.drafter.advance(
                        state.draft_state, path_features, accepted_tokens, verdict.bonus
                    )
            else:  # the next step that drafts catches up (``_catch_up``)
                state.deferred_advance.append((path_features, accepted_tokens))
        state.root_token = verdict.bonus
        if state.context is not None:
            committed = [*accepted_tokens[1:].tolist(), verdict.bonus]
            state.context.observe(drafted.context, committed)
            state.context.extend(committed)
        if sum(len(tokens) for _, tokens in state.deferred_advance) >= MAX_DEFERRED_TOKENS:
            self._catch_up([state])  # bounded memory however long drafting stays off
        if config.logprobs is not None:
            # Token i of the path (and then the bonus) was chosen by the row of its parent.
            chosen = torch.cat([accepted_tokens[1:], accepted_tokens.new_tensor([verdict.bonus])])
            with record_function("selfspec.logprobs"):
                rows = logits[verdict.accepted.to(logits.device)]  # [A, vocab]
                state.step_logprobs = token_logprobs(rows, chosen, config.logprobs)
        state.overhead_seconds = _moving_average(
            state.overhead_seconds, elapsed_seconds(started, logits.device)
        )
        if tree.scores is not None and tree.size > 1:
            state.drafts_predicted += float(tree.scores[1:].exp().sum())
            state.drafts_accepted += verdict.num_drafted_accepted
        state.stats.steps.append(
            StepRecord(
                accepted=verdict.num_drafted_accepted,
                tree_size=tree.size,
                tree_depth=int(tree.depths.max()),
            )
        )
        return [*accepted_tokens[1:].tolist(), verdict.bonus]


class GenerationStream:
    """One request. Iterate to get StepOutputs as they are committed; ``result`` once exhausted.

    A scheduler can drive it explicitly instead: ``start()`` (prefill), then until ``done``
    either ``step()`` (draft, its own forward, verify), or ``draft()``, a forward it runs itself
    together with other requests' trees (``selfspec.batched_verify``), and ``conclude()``.
    Grad mode and the request's scope are entered per call, never held between calls: the
    caller (a server interleaving requests, a training loop) runs in its own modes meanwhile.
    """

    def __init__(
        self,
        generator: SpeculativeGenerator,
        prompt_ids: list[int],
        config: GenerationConfig,
        scope: StepScope,
    ) -> None:
        self._owner = generator
        self._scope = scope
        self._prompt_ids = prompt_ids
        self._config = config
        self._stop_ids = set(
            config.stop_token_ids
            if config.stop_token_ids is not None
            else generator.default_stop_ids
        )
        self._state: RequestState | None = None
        self._prefill: PrefillProgress | None = None
        self._prefill_seconds = 0.0
        self._result: GenerationResult | None = None
        self._decode_started = 0.0
        self._gate = self._speculation_gate()

    @property
    def owner(self) -> SpeculativeGenerator:
        return self._owner

    @property
    def prompt_ids(self) -> list[int]:
        return self._prompt_ids

    @property
    def trees_may_vary(self) -> bool:
        """Whether skipping or resizing this request's drafts leaves its output what it would
        be: greedy (lossless: the same tokens) or unseeded sampling (a draw from the same
        distribution). A seeded sampled request repeats exactly only with the same trees."""
        return self._config.sampling.greedy or self._config.seed is None

    @property
    def state(self) -> RequestState | None:
        """None until ``start()``."""
        return self._state

    @property
    def done(self) -> bool:
        return self._result is not None

    @property
    def result(self) -> GenerationResult:
        if self._result is None:
            raise RuntimeError("the stream has not finished yet")
        return self._result

    def __iter__(self) -> Iterator[StepOutput]:
        output = self.start()
        if output.token_ids:
            yield output
        while not self.done:
            output = self.step()
            if output.token_ids:
                yield output

    def start(self) -> StepOutput:
        """Prefill the prompt and commit the first token."""
        output = self.prefill()
        assert output is not None  # no chunk limit: the whole prompt
        return output

    @property
    def prefill_remaining(self) -> int:
        """Prompt tokens not yet prefilled (0 once started)."""
        if self._state is not None:
            return 0
        if self._prefill is None:
            return len(self._prompt_ids)
        return self._prefill.remaining

    def prefill(self, max_tokens: int | None = None) -> StepOutput | None:
        """Prefill up to ``max_tokens`` more prompt tokens (None: all the rest), a chunk a call
        (``selfspec.prefill``) in a forward of its own; once the prompt is done, commit the
        first token and return its output (as ``start``), until then None."""
        _, chunk = self.next_prefill_chunk(max_tokens)
        return self.run_chunk(chunk)

    def run_chunk(self, chunk: PrefillChunk) -> StepOutput | None:
        """Run ``chunk`` (``next_prefill_chunk``'s) in a forward of its own and take it in
        (``absorb_prefill``)."""
        if self._prefill is None:
            raise RuntimeError("no prefill in progress")
        started = time.perf_counter()
        with torch.inference_mode(), self._scope():
            features, tapped = run_prefill_chunk(self._owner.target, self._prefill, chunk)
        return self.absorb_prefill(chunk, features, tapped, time.perf_counter() - started)

    def next_prefill_chunk(
        self, max_tokens: int | None = None
    ) -> tuple[PrefillProgress, PrefillChunk]:
        """The prefill (begun on the first call: a cached prefix of the prompt copied into its
        cache) and the prompt tokens its next chunk runs, up to ``max_tokens`` (None: the
        rest), for a forward of its own (``prefill``) or one shared with other requests
        (``selfspec.batched_verify.verify_rows``); then ``absorb_prefill``."""
        if self._state is not None:
            raise RuntimeError("the stream was already started")
        owner = self._owner
        started = time.perf_counter()
        with torch.inference_mode(), self._scope():
            if self._prefill is None:
                prompt = torch.tensor(
                    self._prompt_ids, dtype=torch.long, device=owner.target.device
                )
                self._prefill = owner.begin_prefill(prompt, self._config)
            chunk = owner.next_prefill_chunk(self._prefill, max_tokens)
        self._prefill_seconds += time.perf_counter() - started
        return self._prefill, chunk

    def absorb_prefill(
        self,
        chunk: PrefillChunk,
        features: torch.Tensor,  # [n, H]
        tapped: torch.Tensor | None,  # [n, k * H]
        seconds: float,
    ) -> StepOutput | None:
        """Take the forward of ``chunk`` (``seconds``: its share of that forward's time);
        once the prompt is done, commit the first token and return its output, until then
        None."""
        if self._prefill is None or self._state is not None:
            raise RuntimeError("no prefill in progress")
        owner = self._owner
        started = time.perf_counter()
        with torch.inference_mode(), self._scope():
            state = owner.absorb_prefill_chunk(self._prefill, self._config, chunk, features, tapped)
        self._prefill_seconds += seconds + time.perf_counter() - started
        if state is None:
            return None
        self._prefill = None
        self._state = state
        state.stats.prompt_tokens = len(self._prompt_ids)
        state.stats.prefill_seconds = self._prefill_seconds
        output = self._commit(state, [state.root_token], self._stop_ids)
        output.prompt_logprobs = state.prompt_logprobs
        self._decode_started = time.perf_counter()
        self._finish_if_stopped(state)
        return output

    def step(self) -> StepOutput:
        """One decoding step with its own verification forward. With the generator's default
        adaptive tree (or any adaptive one), its speculation gate decides whether the step
        drafts at all (``SpeculativeGenerator.gate``): speculation never loses to plain
        decoding for long, and the output is what it would be either way."""
        gate = self._gate
        if gate is None:
            return self.verify(self.draft())
        speculate = gate.choose(1)
        started = time.perf_counter()
        output = self.verify(self.draft(speculate=speculate))
        gate.observe(1, speculate, len(output.token_ids), time.perf_counter() - started)
        return output

    def _speculation_gate(self) -> SpeculationGate | None:
        """The generator's gate if ``step`` asks it (decided once, when the request starts): a
        speculating request on an adaptive tree whose output does not depend on its trees
        (``trees_may_vary``); else None."""
        owner, config = self._owner, self._config
        if not config.speculate or owner.gate is None or not self.trees_may_vary:
            return None
        tree = owner.tree_for(config)
        return owner.gate if isinstance(tree, DynamicTree) and tree.adaptive else None

    def verify(self, drafted: DraftedStep) -> StepOutput:
        """Finish the step of ``draft()`` with a verification forward of its own."""
        state = self._decoding_state()
        with torch.inference_mode(), self._scope():
            committed = self._owner.verify(state, self._config, drafted)
        return self._after_step(state, committed)

    def draft(
        self, batch_size: int = 1, speculate: bool = True, joint: bool = False
    ) -> DraftedStep:
        """The next step's tree; its forward is the caller's, then ``conclude``. batch_size: the
        requests that forward will verify together (this one included); speculate False: no
        drafts this step (the server's goodput gate), the output unchanged; joint: the caller
        sizes the batch's adaptive trees together (``resize``)."""
        state = self._decoding_state()
        with torch.inference_mode(), self._scope():
            return self._owner.draft(state, self._config, batch_size, speculate, joint)

    @staticmethod
    def draft_together(
        streams: Sequence[GenerationStream],
        batch_size: int,
        speculate: Sequence[bool],
        joint: Sequence[bool],
    ) -> list[DraftedStep]:
        """Each stream's next tree, as its ``draft`` would give it, drafted in one batched call
        of the heads they share. The streams share their generator and their adapter: the first
        one's scope is entered for all (drafting reads the adapter only through the heads'
        draft deltas and the target's embeddings)."""
        owner = streams[0]._owner
        if any(stream._owner is not owner for stream in streams):
            raise ValueError("streams drafted together must share their SpeculativeGenerator")
        steps = [
            StepToDraft(stream._decoding_state(), stream._config, own, shared)
            for stream, own, shared in zip(streams, speculate, joint, strict=True)
        ]
        with torch.inference_mode(), streams[0]._scope():
            return owner.draft_many(steps, batch_size)

    def resize(self, drafted: DraftedStep, count: int, as_drawn: bool = False) -> DraftedStep:
        """``drafted`` keeping its ``count`` best drafted nodes (before its forward)."""
        return self._owner.resize(self._decoding_state(), drafted, count, as_drawn)

    def conclude(
        self,
        drafted: DraftedStep,
        features: torch.Tensor,
        logits: torch.Tensor | None = None,
        defer_advance: bool = False,
    ) -> StepOutput:
        """Finish the step of ``draft()``: features # [T, H] of its tree, whose KV entries the
        caller's forward appended to this request's cache (and their logits # [T, vocab], if
        the caller computed them). ``defer_advance``: the draft state catches up when the
        request next drafts (``draft_together`` advances a batch's requests in one call)."""
        state = self._decoding_state()
        with torch.inference_mode(), self._scope():
            committed = self._owner.conclude(
                state, self._config, drafted, features, logits, defer_advance
            )
        return self._after_step(state, committed)

    def _decoding_state(self) -> RequestState:
        if self._state is None:
            raise RuntimeError("start() the stream first")
        if self.done:
            raise RuntimeError("the stream has finished")
        return self._state

    def _after_step(self, state: RequestState, committed: list[int]) -> StepOutput:
        with record_function("selfspec.detokenize"):
            output = self._commit(state, committed, self._stop_ids)
        state.stats.decode_seconds = time.perf_counter() - self._decode_started
        self._finish_if_stopped(state)
        return output

    def _finish_if_stopped(self, state: RequestState) -> None:
        if state.finish_reason is None:
            return
        state.stats.new_tokens = len(state.token_ids)
        self._result = GenerationResult(
            token_ids=state.token_ids,
            text=state.text,
            finish_reason=state.finish_reason,
            stats=state.stats,
            logprobs=state.logprobs,
            prompt_logprobs=state.prompt_logprobs,
            features=_recorded_rows(state, len(self._prompt_ids)),
        )

    def _commit(self, state: RequestState, tokens: list[int], stop_ids: set[int]) -> StepOutput:
        """Append tokens up to the first stop condition; returns what was appended."""
        config = self._config
        kept: list[int] = []
        for token in tokens:
            kept.append(token)
            if token in stop_ids:
                state.finish_reason = FinishReason.STOP
                break
            if len(state.token_ids) + len(kept) >= config.max_new_tokens:
                state.finish_reason = FinishReason.LENGTH
                break
        state.token_ids.extend(kept)
        logprobs = None
        if state.logprobs is not None:
            logprobs = state.step_logprobs[: len(kept)]
            state.logprobs.extend(logprobs)
            state.step_logprobs = []
        if self._owner.tokenizer is None:
            return StepOutput(token_ids=kept, text="", logprobs=logprobs)
        text = self._owner.tokenizer.decode(state.token_ids, skip_special_tokens=True)
        cut = _first_stop(text, config.stop_strings, len(state.text))
        if cut is not None:
            text = text[:cut]
            state.finish_reason = FinishReason.STOP
        state.text = text
        visible = len(text)
        if state.finish_reason is None:
            # Hold back what may still change: an incomplete multi-byte character, and a tail
            # that could be the start of a stop string (it must never reach the client).
            visible = len(text.rstrip("\ufffd"))
            if config.stop_strings:
                visible = min(visible, len(text) - max(map(len, config.stop_strings)) + 1)
        delta = text[state.streamed_chars : max(visible, state.streamed_chars)]
        state.streamed_chars += len(delta)
        return StepOutput(token_ids=kept, text=delta, logprobs=logprobs)


def _first_stop(text: str, stops: tuple[str, ...], checked_up_to: int) -> int | None:
    """Index of the earliest stop string that ends after ``checked_up_to``."""
    found = None
    for stop in stops:
        index = text.find(stop, max(0, checked_up_to - len(stop) + 1))
        if index >= 0 and (found is None or index < found):
            found = index
    return found


def _recorded(features: torch.Tensor, tapped: torch.Tensor | None = None) -> torch.Tensor:
    """Features kept for ``GenerationConfig.record_features``: the last hidden states
    ``features`` # [n, H], after the ``tapped`` layers' states # [n, k*H] where the heads read
    some (``split_recorded`` takes them apart) # [n, F], float16 on the CPU."""
    rows = features if tapped is None else torch.cat([tapped, features], dim=-1)
    return rows.detach().to("cpu", torch.float16)


def split_recorded(features: Rows, layers: int) -> tuple[Rows | None, Rows]:
    """``GenerationResult.features`` (a tensor or an array) of heads reading ``layers`` tapped
    layers (0: none) as (the tapped states # [n, layers * H] or None, the last hidden states
    # [n, H])."""
    if features.shape[-1] % (layers + 1):
        raise ValueError(
            f"recorded features of width {features.shape[-1]} do not hold {layers} tapped "
            "layer(s) and the last hidden state"
        )
    hidden = features.shape[-1] // (layers + 1)
    if not layers:
        return None, features
    return features[..., :-hidden], features[..., -hidden:]


def _recorded_rows(state: RequestState, prompt_len: int) -> torch.Tensor | None:
    """The recorded features of the prompt and the kept output but its last token
    # [S + N - 1, F], or None when none were recorded."""
    if state.recorded_features is None:
        return None
    rows = prompt_len + len(state.token_ids) - 1
    features = torch.cat(state.recorded_features)
    if features.shape[0] < rows:  # a prefix reused without its features: nothing usable
        return None
    return features[:rows]


def _take_draft_features(state: RequestState) -> torch.Tensor:
    """The tapped states of the tree just verified, taken so no later step reuses them."""
    draft_features, state.draft_features = state.draft_features, None
    if draft_features is None:
        raise RuntimeError(
            "this request's heads read tapped target layers (EAGLE-3), but its verification "
            "forward ran without the taps (verify through SpeculativeGenerator.verify or "
            "selfspec.batched_verify.verify_features)"
        )
    return draft_features  # [T, k * H]


def after_prefix_mask(start: int, end: int, target: TargetForward) -> torch.Tensor:
    """Prompt tokens start..end-1 over a cache holding the first ``start``: all of it visible,
    causal among themselves. # [1, 1, end - start, end] additive float mask"""
    size = end - start
    dtype, device = target.dtype, target.device
    blocked = torch.ones(size, size, dtype=torch.bool, device=device).triu(1)
    mask = torch.zeros(1, 1, size, end, dtype=dtype, device=device)
    mask[0, 0, :, start:] = torch.where(blocked, torch.finfo(dtype).min, 0.0).to(dtype)
    return mask


def _moving_average(average: float, sample: float) -> float:
    """One step of the exponential moving averages tree sizing reads (cost scale, overhead)."""
    return COST_SCALE_DECAY * average + (1 - COST_SCALE_DECAY) * sample


def _choose(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> int:
    """logits: # [vocab]"""
    if params.greedy:
        return int(greedy_tokens(logits))
    return int(sample_from(warp_probs(logits, params), generator))


def _root_only(root_token: int, device: torch.device) -> Tree:
    zero = torch.zeros(1, dtype=torch.long, device=device)
    return Tree(
        tokens=torch.tensor([root_token], device=device),
        parents=torch.tensor([-1], device=device),
        depths=zero,
        draw_ranks=zero,
        expanded_row=torch.tensor([-1], device=device),
        draft_probs=torch.zeros(0, 1, device=device),
        draws=torch.full((1, 1), -1, device=device),
        sampling=DraftSampling.TOP_K,
    )


def _context_limit(model: PreTrainedModel) -> int | None:
    config = model.config
    for name in ("max_position_embeddings", "n_positions"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def eos_token_ids(model: PreTrainedModel, tokenizer: Any) -> tuple[int, ...]:
    """Every id that ends a response: the tokenizer's, the model config's and the generation
    config's EOS ids, sorted (empty when none names one)."""
    ids: set[int] = set()
    sources = [
        getattr(tokenizer, "eos_token_id", None),
        getattr(model.config, "eos_token_id", None),
    ]
    generation_config = getattr(model, "generation_config", None)
    if generation_config is not None:
        sources.append(generation_config.eos_token_id)
    for source in sources:
        if isinstance(source, int):
            ids.add(source)
        elif isinstance(source, list | tuple):
            ids.update(int(i) for i in source)
    return tuple(sorted(ids))
