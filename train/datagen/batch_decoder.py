"""Batched generation through selfspec's own engine: many prompts decoded together.

A data engine spends its hours decoding; one row at a time a forward streams every weight for a
single token. ``BatchDecoder`` runs up to ``batch_size`` rows per forward over a ``SlotCache``
(continuous batching: a finished row's slot takes the next prompt at once, so the batch stays
full), through ``TargetForward``'s lean body and, by default, the row-invariant kernels.

What comes out does not depend on the batch. With the kernels every op computes a row alone
(fixed summation order, attention over the row's own keys only), and each request samples from
its own ``torch.Generator`` seeded by the request: a request gives the same tokens whether it
ran alone, in a batch of 32, early or late in a run (tested). That is what makes a resumed or
re-sharded run reproduce an uninterrupted one. (Without the kernels, transformers' ops round a
row differently with the batch size; results are then the same up to float noise.)

By-product: with ``taps`` the target's states at those layers are recorded for every position
fed (the prompt and all response tokens but the last), float16 # [n - 1, k * H], the EAGLE-3
training input, so training need not run the target again.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from transformers import PreTrainedModel

from selfspec.drafting.taps import LayerTaps, maybe_capture
from selfspec.kernels import extension
from selfspec.sampling import SamplingParams, greedy_tokens, sample_from, warp_probs
from selfspec.target_forward import TargetForward
from selfspec.train.datagen.slot_cache import SlotCache


@dataclass(frozen=True)
class GenerationRequest:
    key: str
    """The caller's name for it; results come back in completion order, named by it."""
    prompt: tuple[int, ...]
    max_new_tokens: int
    sampling: SamplingParams = SamplingParams()
    seed: int = 0
    stop_ids: tuple[int, ...] = ()
    """The response ends with the first of these (kept in the response)."""


@dataclass(frozen=True)
class GenerationResult:
    key: str
    prompt: tuple[int, ...]
    response: tuple[int, ...]
    finished: bool
    """True when the response ended on a stop id, False when it ran to max_new_tokens."""
    features: np.ndarray | None = None
    """Tapped states for every fed position, float16 # [len(prompt) + len(response) - 1, k*H]."""


@dataclass
class _Row:
    request: GenerationRequest
    generator: torch.Generator
    response: list[int] = field(default_factory=list)
    states: list[torch.Tensor] = field(default_factory=list)  # [n_i, k*H] float16 each


class BatchDecoder:
    """Decodes requests ``batch_size`` at a time through the model's lean body (Llama, Qwen2,
    Mistral: the slot cache is driven through it). Where the C++ kernels are built, attention
    runs through their fixed-order kernel, whatever runs the linear layers: a batch of ragged
    rows then reads only its own keys (measured on SmolLM2-135M, bf16 with oneDNN's linear
    layers, batch 32, 1 thread: 208 vs 151 tok/s with SDPA over the padded window)."""

    def __init__(
        self,
        model: PreTrainedModel,
        batch_size: int = 32,
        max_prompt_tokens: int = 1024,
        max_new_tokens: int = 512,
        tap_layers: Sequence[int] = (),
    ) -> None:
        """``tap_layers``: record the target's states at these layers (HF hidden-state indices,
        see ``LayerTaps``) for every fed position; empty: none."""
        target = TargetForward(model, fixed_order_attention=extension.load() is not None or None)
        if target.lean is None:
            raise ValueError(
                f"batched generation needs a Llama-family body (llama, qwen2, mistral); "
                f"{type(target.body).__name__} is not one"
            )
        if batch_size < 1 or max_prompt_tokens < 1 or max_new_tokens < 1:
            raise ValueError(
                "BatchDecoder needs batch_size, max_prompt_tokens and max_new_tokens >= 1, got "
                f"{batch_size}, {max_prompt_tokens}, {max_new_tokens}"
            )
        self.target = target
        self.taps = LayerTaps(target.body, tap_layers) if tap_layers else None
        self.batch_size = batch_size
        self.max_prompt_tokens, self.max_new_tokens = max_prompt_tokens, max_new_tokens
        config = model.config
        heads = config.num_attention_heads
        # The kernels' attention reads only the keys a row's mask allows.
        self._cache_shape = dict(
            masked_reads=target.lean.fixed_order,
            layers=config.num_hidden_layers,
            slots=batch_size,
            kv_heads=getattr(config, "num_key_value_heads", None) or heads,
            head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
            # room for the longest row after the reserve, plus half as much between compactions
            capacity=max_prompt_tokens + (3 * (max_prompt_tokens + max_new_tokens)) // 2 + 1,
            dtype=target.dtype,
            reserve=max_prompt_tokens,
        )
        self._cache: SlotCache | None = None  # allocated at the first generate, then reused

    def check(self, request: GenerationRequest) -> None:
        if not 1 <= len(request.prompt) <= self.max_prompt_tokens:
            raise ValueError(
                f"request {request.key}: prompt of {len(request.prompt)} tokens, need 1.."
                f"{self.max_prompt_tokens}"
            )
        if not 1 <= request.max_new_tokens <= self.max_new_tokens:
            raise ValueError(
                f"request {request.key}: max_new_tokens {request.max_new_tokens}, need 1.."
                f"{self.max_new_tokens}"
            )

    @torch.no_grad()
    def generate(
        self,
        requests: Iterable[GenerationRequest],
        on_tokens: Callable[[int], None] | None = None,
    ) -> Iterator[GenerationResult]:
        """Every request's result, in the order they finish. ``on_tokens(n)`` after each step
        with the number of response tokens it produced (progress bars)."""
        pending = iter(requests)
        if self._cache is None:
            self._cache = SlotCache(**self._cache_shape)
        cache = self._cache
        cache.reset()
        rows: list[_Row] = []  # row i lives in slot i
        tokens = torch.zeros(self.batch_size, dtype=torch.long)  # each slot's next input
        while True:
            # Fill the free slots (slot len(rows) is the next free one), prompt by prompt.
            while len(rows) < self.batch_size:
                request = next(pending, None)
                if request is None:
                    break
                self.check(request)
                if cache.free_columns() < request.max_new_tokens + 1:
                    cache.compact()
                row, first = self._prefill(request, cache, len(rows))
                if on_tokens is not None:
                    on_tokens(1)
                if self._done(row):
                    cache.release(len(rows))
                    yield self._result(row)
                    continue
                tokens[len(rows)] = first
                rows.append(row)
            if not rows:
                return
            if cache.free_columns() < 1:
                cache.compact()
            chosen = self._step(cache, tokens, rows)
            if on_tokens is not None:
                on_tokens(len(chosen))
            tokens[: len(rows)] = torch.tensor(chosen)
            # Finished rows leave; the last live row moves into each hole (live slots stay 0..A-1).
            for slot in reversed(range(len(rows))):
                if not self._done(rows[slot]):
                    continue
                yield self._result(rows[slot])
                last = len(rows) - 1
                if slot != last:
                    cache.move(last, slot)
                    rows[slot], tokens[slot] = rows[last], tokens[last]
                else:
                    cache.release(slot)
                rows.pop()

    def _prefill(self, request: GenerationRequest, cache: SlotCache, slot: int):
        generator = torch.Generator().manual_seed(request.seed)
        row = _Row(request, generator)
        prompt = torch.tensor(request.prompt, dtype=torch.long)[None]  # [1, p]
        prompt_cache = self.target.new_cache()
        positions = torch.arange(prompt.shape[1])[None]
        with maybe_capture(self.taps) as tapped:
            features = self.target.features(prompt, positions, prompt_cache)  # [1, p, H]
        if tapped is not None:
            row.states.append(tapped.stacked()[0].to(torch.float16))  # [p, k*H]
        cache.place(slot, prompt_cache)
        first = self._choose(self.target.logits(features[:, -1]), [row])[0]
        row.response.append(first)
        return row, first

    def _step(self, cache: SlotCache, tokens: torch.Tensor, rows: list[_Row]) -> list[int]:
        """One forward of every live row's next token; returns the tokens chosen, row by row."""
        count = len(rows)
        mask = cache.begin(count).to(self.target.dtype)  # [A, 1, 1, window]
        positions = cache.positions(count)  # [A, 1]
        with maybe_capture(self.taps) as tapped:
            features = self.target.features(tokens[:count, None], positions, cache, mask)
        cache.advance()
        if tapped is not None:
            states = tapped.stacked()[:, 0].to(torch.float16)  # [A, k*H]
            for row, state in zip(rows, states, strict=True):
                row.states.append(state[None])
        chosen = self._choose(self.target.logits(features[:, 0]), rows)
        for row, token in zip(rows, chosen, strict=True):
            row.response.append(token)
        return chosen

    @staticmethod
    def _choose(logits: torch.Tensor, rows: list[_Row]) -> list[int]:
        """logits: # [A, vocab] -> one token per row, greedy or from the row's generator."""
        greedy = greedy_tokens(logits).tolist()
        out = []
        for index, row in enumerate(rows):
            sampling = row.request.sampling
            if sampling.greedy:
                out.append(int(greedy[index]))
            else:
                probs = warp_probs(logits[index], sampling)
                out.append(int(sample_from(probs, row.generator)))
        return out

    @staticmethod
    def _done(row: _Row) -> bool:
        request = row.request
        return row.response[-1] in request.stop_ids or len(row.response) >= request.max_new_tokens

    def _result(self, row: _Row) -> GenerationResult:
        request = row.request
        features = None
        if self.taps is not None:
            fed = len(request.prompt) + len(row.response) - 1
            features = torch.cat(row.states)[:fed].numpy()  # [fed, k*H]
        return GenerationResult(
            key=request.key,
            prompt=request.prompt,
            response=tuple(row.response),
            finished=row.response[-1] in request.stop_ids,
            features=features,
        )
