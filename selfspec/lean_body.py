"""The target's decoder body without transformers' per-layer Python: the same ops, the same bits.

A decoding step runs the whole body for a handful of tokens, so on a CPU its time is the weights
streaming through the linear layers plus a few dozen small tensor ops per layer, and the Python
around them: the decoder layer and attention modules with their decorators and keyword plumbing,
the attention-function registry, mask creation, ``rotate_half``'s slices and concatenation,
``repeat_kv``'s copies of the cache. Measured on this project's CPU (SmolLM2-135M, bf16, packed
weights, 1 thread): a 4- or 8-token tree forward 0.86x the HF body's time, selfspec's vanilla
loop 1.06-1.12x faster in two runs (``benchmarks/speed.py`` runs a vanilla row over the HF body
beside it).

``LeanBody`` runs a Llama-family body (Llama, Qwen2, Mistral; full attention, SDPA) from the
body's own modules. The embedding, rotary embedding, norms, projections and MLPs are *called*,
as they are: peft's LoRA layers, the LoRA bank's hooks and packed weights apply unchanged. Only
the glue is written here, op for op what transformers computes: rotary application (the
half rotation done by swapping the halves against a sign-folded sine, which rounds exactly as
``rotate_half``'s negation does), the KV cache update (``Cache.update``), the SDPA call with
the arguments and query layout transformers' ``sdpa`` attention uses (grouped heads read in
place rather than repeated), and the residual adds. The output is bit-identical to the HF body
in every dtype: tests compare with ``torch.equal`` on tiny models of each architecture, with
tree masks, batched masks, packed weights and LoRA adapters.

When the body's linear layers run through ``selfspec.kernels`` (``KernelLinear``), attention
runs through the kernels' fixed-order attention instead of SDPA: each query row visits only the
keys its mask allows, in key order, so the whole forward is row-invariant (a tree token's result
equals the same token decoded alone, bit for bit, in every dtype). That path matches the HF body
within float noise, not bit for bit.

Anything else (another architecture, sliding-window layers, eager or flash attention, training
mode, a multi-token forward over a cache without an explicit mask) is left to transformers:
``unsupported_reason`` says why for a body, ``covers`` for a call.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn
from torch.nn import functional as F
from transformers import Cache

from selfspec.fused_body import FusedBody, WholeBody
from selfspec.fused_layer import FUSED_DTYPES, NOT_FUSED, FusedLayer, unfusable_reason
from selfspec.growing_cache import GrowingLayer
from selfspec.kernels import extension
from selfspec.kernels import ops as kernels
from selfspec.kernels.modules import uses_kernels
from selfspec.reader_hooks import reader_hooks

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "mistral")
_LAYER_PARTS = ("input_layernorm", "self_attn", "post_attention_layernorm", "mlp")
_ATTENTION_PARTS = ("q_proj", "k_proj", "v_proj", "o_proj", "head_dim", "scaling")
_NORMS = ("input_layernorm", "post_attention_layernorm")


def unsupported_reason(body: nn.Module) -> str | None:
    """Why ``LeanBody`` can't run ``body`` exactly as transformers does, or None if it can."""
    config = getattr(body, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        return f"model type {model_type!r} is not one of {SUPPORTED_MODEL_TYPES}"
    for part in ("embed_tokens", "layers", "norm", "rotary_emb"):
        if not hasattr(body, part):
            return f"the body has no {part!r}"
    if getattr(config, "sliding_window", None) is not None and any(
        kind != "full_attention" for kind in getattr(config, "layer_types", None) or ["sliding"]
    ):
        return "sliding-window attention layers"
    for index, layer in enumerate(body.layers):
        missing = [part for part in _LAYER_PARTS if not hasattr(layer, part)]
        missing += [
            f"self_attn.{part}" for part in _ATTENTION_PARTS if not hasattr(layer.self_attn, part)
        ]
        if missing:
            return f"decoder layer {index} has no {', '.join(missing)}"
        extra = [part for part in ("q_norm", "k_norm") if hasattr(layer.self_attn, part)]
        if extra:
            return f"decoder layer {index} normalises its queries/keys ({', '.join(extra)})"
    return None


class LeanBody:
    """Runs a supported decoder body (see ``unsupported_reason``) for decoding. Holds no state
    but the body; every call passes its cache."""

    def __init__(self, body: nn.Module, fixed_order_attention: bool | None = None) -> None:
        """``fixed_order_attention``: attention through the kernels' fixed-order attention.
        None: exactly when the linear layers run through the kernels (then every op of a
        forward is row-invariant and a tree verifies exactly as plain decoding). True with
        transformers' linear layers is for batched generation (``selfspec.train.datagen``):
        a batch of ragged rows then attends to its own keys only, several times faster than
        SDPA over a padded window, no longer bit-identical to the HF body."""
        reason = unsupported_reason(body)
        if reason is not None:
            raise ValueError(f"LeanBody can't run {type(body).__name__}: {reason}")
        self.body = body
        self.config = body.config
        self.layers = list(body.layers)
        self.fixed_order = (
            uses_kernels(body) if fixed_order_attention is None else fixed_order_attention
        )
        # With fixed-order attention, an fp32 forward's RMS norms and rotary embedding run as one
        # C++ call each instead of ~8 and ~6 small torch ops (a 1-token step makes ~400 such
        # calls): the norm in its own fixed order per row, the rotary with the same bits.
        norms = [body.norm] + [getattr(layer, part) for layer in self.layers for part in _NORMS]
        self.fused_glue = (
            self.fixed_order and extension.load() is not None and all(map(_plain_norm, norms))
        )
        # With the fused glue, a layer's parts run as one C++ call each where nothing (a hook,
        # an adapter) is in their way (``selfspec.fused_layer``): the same bits, less Python.
        self.fused_layers: list[FusedLayer | None] = [
            FusedLayer(layer) if self.fused_glue and unfusable_reason(layer) is None else None
            for layer in self.layers
        ]
        # When every layer runs fused and the cache grows in place, the whole body is one C++
        # call (``decoder_body``; SmolLM2-135M's 1-token body 11.7 -> 10.8 ms, AVX-512, 1
        # thread), asked for in one flat check (``selfspec.fused_body``).
        self.fused_body = (
            FusedBody(self.fused_layers)  # type: ignore[arg-type]  # none is None here
            if self.fused_layers
            and all(fast is not None for fast in self.fused_layers)
            and len({fast.dtype for fast in self.fused_layers}) == 1  # type: ignore[union-attr]
            else None
        )

    def covers(
        self,
        input_ids: torch.Tensor,  # [B, S]
        cache: Cache,
        attention_mask: torch.Tensor | None,  # [B, 1, S, cache + S] or None
    ) -> bool:
        """Whether this call computes what the HF body would: SDPA attention in eval mode, and
        either an explicit 4D mask, a single token, or a causal prompt over an empty cache."""
        if self.config._attn_implementation != "sdpa" or self.body.training:
            return False
        if attention_mask is not None:
            return attention_mask.dim() == 4 and attention_mask.dtype.is_floating_point
        return input_ids.shape[1] == 1 or cache.get_seq_length() == 0

    def __call__(
        self,
        input_ids: torch.Tensor,  # [B, S]
        position_ids: torch.Tensor,  # [B, S]
        cache: Cache,
        attention_mask: torch.Tensor | None = None,  # [B, 1, S, cache + S] float, or None
    ) -> torch.Tensor:
        """The body's last hidden state # [B, S, H]; appends S entries to every layer's cache."""
        body = self.body
        hidden = body.embed_tokens(input_ids)  # [B, S, H]
        cos, sin = body.rotary_emb(hidden, position_ids=position_ids)  # [B, S, D] each
        signed_sin = sign_folded(sin)
        # fp32 runs its norms and rotary through the kernels (the glue) wherever it runs part by
        # part; fp32 and bf16 layers run fused (C++) where nothing is in the way, bf16 with the
        # very ops of its module path.
        fused = self.fused_glue and hidden.dtype in FUSED_DTYPES
        glue = fused and hidden.dtype == torch.float32
        norm = _fused_norm if glue else _module_norm
        # [B, S, D] for the C++ calls; [B, S, 1, D] for the module path's rotary
        cos_heads, sin_heads = (
            (cos, signed_sin) if glue else (cos[:, :, None], signed_sin[:, :, None])
        )
        rotate = _fused_rotate if glue else _rotate
        batch, length = input_ids.shape
        causal = attention_mask is None and length > 1  # a prompt over an empty cache
        fixed_mask = (
            attention_mask[:, 0].float()
            if self.fixed_order and attention_mask is not None
            else None
        )  # [B, S, cache + S]
        isa = extension.requested_isa() if fused else "auto"
        whole = self._whole_body_plan(hidden, [cache]) if fused else None
        if whole is not None:
            masks = [None] * batch if fixed_mask is None else list(fixed_mask.split(1))
            caches = [(cache, batch, length)]
            hidden = self._whole_body(whole, hidden, cos, signed_sin, caches, masks, isa)
            return norm(body.norm, hidden)
        for index, layer in enumerate(self.layers):
            attention = layer.self_attn
            head_dim = attention.head_dim
            fast = self.fused_layers[index] if fused else None
            parts = fast.parts(hidden) if fast is not None else NOT_FUSED
            if parts.attention_inputs:
                query, key, value = fast.attention_inputs(hidden, cos, signed_sin, isa)
            else:
                normed = norm(layer.input_layernorm, hidden)
                # [B, S, heads * D] -> [B, S, heads, D], rotated, then -> [B, heads, S, D] (a view)
                query = attention.q_proj(normed).view(batch, length, -1, head_dim)
                key = attention.k_proj(normed).view(batch, length, -1, head_dim)
                value = attention.v_proj(normed).view(batch, length, -1, head_dim).transpose(1, 2)
                query = rotate(query, cos_heads, sin_heads)  # [B, S, heads, D]
                key = rotate(key, cos_heads, sin_heads).transpose(1, 2)
            key, value = cache.update(key, value, index)  # [B, kv_heads, cache + S, D]
            if parts.attention_output:
                hidden = fast.attention_output(hidden, query, key, value, fixed_mask, isa)
            else:
                if self.fixed_order:
                    attended = kernels.attention(query, key, value, fixed_mask, attention.scaling)
                    attended = attended.reshape(batch, length, -1)
                else:
                    query = query.transpose(1, 2)
                    attended = _attend(query, key, value, attention_mask, attention.scaling, causal)
                    attended = attended.transpose(1, 2).contiguous().reshape(batch, length, -1)
                hidden = hidden + attention.o_proj(attended)
            if parts.mlp:
                hidden = fast.mlp_block(hidden, isa)
            else:
                hidden = hidden + layer.mlp(norm(layer.post_attention_layernorm, hidden))
        return norm(body.norm, hidden)

    def rows_forward(
        self,
        input_ids: torch.Tensor,  # [1, N]
        position_ids: torch.Tensor,  # [1, N]
        caches: Sequence[Cache],  # one per row, each of batch 1
        lengths: Sequence[int],  # tokens of each row, back to back: sum N
        masks: Sequence[torch.Tensor],  # [1, lengths[g], cache_g + lengths[g]] additive, per row
    ) -> torch.Tensor | None:
        """The last hidden state # [1, N, H] of rows that each have their own cache (a server's
        requests) and hold ``lengths`` tokens, back to back (no padding), in one whole-body
        call: no cache is copied into a batch, and row g's cache gets its ``lengths[g]``
        entries. A mixed-adapter batch's per-row deltas have one row per request, each added to
        its own tokens. None where the whole body cannot run (the caller stacks the caches into
        one padded batch instead)."""
        body = self.body
        if not (self.fused_glue and self.covers(input_ids, caches[0], masks[0][None])):
            return None
        hidden = body.embed_tokens(input_ids)  # [1, N, H]
        whole = self._whole_body_plan(hidden, caches) if hidden.dtype in FUSED_DTYPES else None
        if whole is None:
            return None
        cos, sin = body.rotary_emb(hidden, position_ids=position_ids)  # [1, N, D] each
        rows = [(cache, 1, length) for cache, length in zip(caches, lengths, strict=True)]
        return self._whole_body(
            whole,
            hidden,
            cos,
            sign_folded(sin),
            rows,
            list(masks),
            extension.requested_isa(),
            lengths,
            final_norm=True,
        )

    def _whole_body_plan(self, hidden: torch.Tensor, caches: Sequence[Cache]) -> WholeBody | None:
        """What the one-call body needs (``selfspec.fused_body``) when every part of every
        layer may run fused in this forward and every cache layer grows in place; else None."""
        if self.fused_body is None:
            return None
        for cache in caches:
            layers = getattr(cache, "layers", None)  # not every cache has them (datagen's slots)
            if (
                not isinstance(layers, list)
                or len(layers) != len(self.layers)
                or any(type(layer) is not GrowingLayer for layer in layers)
            ):
                return None
        return self.fused_body.check(hidden)

    def _whole_body(
        self,
        whole: WholeBody,
        hidden: torch.Tensor,  # [B, S, H]
        cos: torch.Tensor,  # [B, S, D]
        signed_sin: torch.Tensor,  # [B, S, D]
        caches: list[tuple[Cache, int, int]],
        masks: list[torch.Tensor | None],  # [1, S, start + S] per row; None: causal
        isa: str,
        lengths: Sequence[int] | None = None,
        final_norm: bool = False,
    ) -> torch.Tensor:
        """Every decoder layer in one C++ call. ``caches``: (cache, rows, kept): the rows are
        those of the caches in order (a cache of ``rows`` rows serves the next ``rows`` rows of
        the forward); each cache layer gets S entries written in place and ``kept`` of them
        counted (S, or fewer: a tree padded to S). The same bits as the layer-by-layer loop.
        ``lengths``: ragged rows (``rows_forward``), hidden # [1, N, H], cache g (of one row)
        getting ``lengths[g]`` entries. ``readers[l]``: hooks handed the stream entering layer
        l, as its input norm would have been; the linear layers' delta hooks (the LoRA bank's)
        have their deltas added in C++ (a per-row delta: one row per row, or per ragged row).
        ``final_norm``: the body's norm applied. # [B, S, H]"""
        attention = self.layers[0].self_attn
        batch, length, _ = hidden.shape
        segments = batch if lengths is None else len(lengths)
        deltas = whole.deltas(segments)  # a mixed-adapter batch's: one row per segment
        kv_heads = attention.k_proj.out_features // attention.head_dim
        key_rows: list[list[torch.Tensor]] = [[] for _ in self.layers]  # [layer][row]
        value_rows: list[list[torch.Tensor]] = [[] for _ in self.layers]
        starts: list[int] = []
        for segment, (cache, rows, _) in enumerate(caches):
            tokens = length if lengths is None else lengths[segment]
            like = hidden.new_empty(rows, kv_heads, tokens, attention.head_dim)
            reserved = [layer.reserve(like, like) for layer in cache.layers]
            if len({start for _, _, start in reserved}) != 1:
                raise ValueError("a cache's layers hold different lengths")
            starts += [reserved[0][2]] * rows
            for index, (keys, values, _) in enumerate(reserved):
                key_rows[index] += [keys] if rows == 1 else list(keys.split(1))
                value_rows[index] += [values] if rows == 1 else list(values.split(1))
        if len(starts) != segments:
            raise ValueError(f"the caches hold {len(starts)} rows, the forward {segments}")
        readers = whole.readers
        captured = list(readers)
        hidden, *entering = extension.load().decoder_body(
            whole.plan,
            hidden,
            cos,
            signed_sin,
            [keys for layer in key_rows for keys in layer],
            [values for layer in value_rows for values in layer],
            starts,
            masks,
            [] if lengths is None else list(lengths),
            captured,
            [None if delta is None else delta[0] for delta in deltas],
            [None if delta is None else delta[1] for delta in deltas],
            isa,
            None,  # the first layer normalises its own input
        )
        for cache, _, kept in caches:
            for layer in cache.layers:
                layer.extend(kept)
        for index, stream in zip(captured, entering, strict=True):
            norm = self.layers[index].input_layernorm
            for hook in readers[index]:
                hook(norm, (stream,), {})
        return _fused_norm(self.body.norm, hidden) if final_norm else hidden


def _plain_norm(module: nn.Module) -> bool:
    """Whether ``module`` is transformers' plain RMS norm (``weight * (x * rsqrt(mean(x^2) +
    eps))``, as Llama, Qwen2 and Mistral define it)."""
    return (
        type(module).__name__ in ("LlamaRMSNorm", "Qwen2RMSNorm", "MistralRMSNorm")
        and isinstance(getattr(module, "weight", None), torch.Tensor)
        and isinstance(getattr(module, "variance_epsilon", None), float)
    )


def _module_norm(norm: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    return norm(hidden)


def _fused_norm(norm: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """``norm(hidden)`` in one C++ call (fp32 hidden states and weight). Reader hooks on it
    (``selfspec.drafting.taps`` reads the stream entering a layer so, for one forward) are
    handed its input and output; a norm with any other hook is called as a module. # [B, S, H]"""
    hooks = reader_hooks(norm)
    if norm.weight.dtype != torch.float32 or hooks is None:
        return norm(hidden)
    before, after = hooks
    for hook in before:
        hook(norm, (hidden,), {})
    out = kernels.rms_norm(hidden, norm.weight, norm.variance_epsilon)
    for hook in after:
        hook(norm, (hidden,), out)
    return out


def _fused_rotate(
    states: torch.Tensor,  # [B, S, heads, D] float32, a projection's fresh output
    cos: torch.Tensor,  # [B, S, D]
    signed_sin: torch.Tensor,  # [B, S, D]
) -> torch.Tensor:
    """``_rotate`` in one C++ call, in place, the same bits. # [B, S, heads, D]"""
    if states.dtype != torch.float32 or not states.is_contiguous():
        return _rotate(states, cos.unsqueeze(2), signed_sin.unsqueeze(2))
    return kernels.rotary_(states, cos, signed_sin)


def sign_folded(sin: torch.Tensor) -> torch.Tensor:
    """``sin`` with its first half negated. # [..., D] -> [..., D]

    ``rotate_half(x) * sin`` is ``cat(-x2, x1) * sin``; ``cat(x2, x1) * sign_folded(sin)`` gives
    the same bits (a product's magnitude does not depend on which factor carries the sign) with
    one sign flip per forward instead of one per layer and tensor."""
    half = sin.shape[-1] // 2
    return torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)


def _rotate(
    states: torch.Tensor,  # [B, S, heads, D], contiguous
    cos: torch.Tensor,  # [B, S, 1, D]
    signed_sin: torch.Tensor,  # [B, S, 1, D]
) -> torch.Tensor:
    """Rotary position embedding as transformers applies it (``x * cos + rotate_half(x) * sin``),
    elementwise, so applied before the heads are transposed (no copy of a strided tensor).
    # [B, S, heads, D]"""
    batch, length, heads, dim = states.shape
    swapped = states.view(batch, length, heads, 2, dim // 2).flip(3).view(batch, length, heads, dim)
    return (states * cos) + (swapped * signed_sin)


def _attend(
    query: torch.Tensor,  # [B, heads, S, D]
    key: torch.Tensor,  # [B, kv_heads, K, D]
    value: torch.Tensor,  # [B, kv_heads, K, D]
    attention_mask: torch.Tensor | None,  # [B, 1, S, K] or None
    scaling: float,
    causal: bool,
) -> torch.Tensor:
    """SDPA called as transformers' ``sdpa`` attention calls it on CPU. # [B, heads, S, D]

    Grouped-query heads, three cases as there: without a mask SDPA groups them itself
    (``enable_gqa``); one query with a mask runs as ``groups`` queries per key/value head
    (transformers' ``pack_gqa``; SDPA rounds differently for one query row than for several, so
    this case must be packed exactly so); several queries with a mask, where transformers repeats
    the key/value heads (``repeat_kv``, two copies of the cache per layer), read each query head's
    key/value head in place with ``enable_gqa``: the same numbers through the same kernel, the
    same bits (tested with tree and batched masks)."""
    batch, heads, length, dim = query.shape
    kv_heads = key.shape[1]
    if heads != kv_heads and attention_mask is not None and length == 1:
        packed = query.reshape(batch, kv_heads, heads // kv_heads, dim)
        attended = F.scaled_dot_product_attention(
            packed, key, value, attn_mask=attention_mask, dropout_p=0.0, scale=scaling
        )
        return attended.reshape(batch, heads, 1, dim)
    return F.scaled_dot_product_attention(
        query,
        key,
        value,
        attn_mask=attention_mask,
        dropout_p=0.0,
        scale=scaling,
        is_causal=causal,
        enable_gqa=heads != kv_heads,
    )
