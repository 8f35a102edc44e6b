"""EAGLE head: one decoder layer that predicts the target's next feature.

Input at position t+1 is ``fc([embed(token_{t+1}); feature_t])`` with the target's own embedding
table; the layer attends over earlier positions through its own small KV cache; its output is
the predicted feature at t+1, which the target's own lm_head turns into logits for token t+2.
The layer is written here (RMSNorm, rotary attention, SwiGLU MLP), independent of the target's
architecture, so it attaches to any HF causal LM.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from selfspec.growing_cache import MIN_CAPACITY, buffer_like, grown_buffer
from selfspec.heads.config import HeadKind, HeadsConfig
from selfspec.heads.draft_vocab import register_draft_vocab
from selfspec.heads.registry import register_heads


@dataclass
class EagleCache:
    """Keys and values of the EAGLE layer(s) for one request. Owned by the request's state.

    Without autograd each layer's entries live in a buffer with spare capacity (doubling when
    full) and a step writes only its own (``reserve`` / ``extend``, also used by the fused head,
    ``selfspec.drafting.fused_head``); with autograd (training) an append concatenates, as the
    graph needs every earlier tensor unchanged."""

    buffers: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    """Per layer (keys, values) # [B, kv_heads, capacity, head_dim]."""
    lengths: list[int] = field(default_factory=list)
    """Per layer: filled entries of its buffers."""

    @property
    def length(self) -> int:
        return self.lengths[0] if self.lengths else 0

    @property
    def keys(self) -> list[torch.Tensor]:  # per layer [B, kv_heads, length, head_dim]
        return [k[..., :n, :] for (k, _), n in zip(self.buffers, self.lengths, strict=True)]

    @property
    def values(self) -> list[torch.Tensor]:
        return [v[..., :n, :] for (_, v), n in zip(self.buffers, self.lengths, strict=True)]

    def append(
        self, layer: int, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Add ``k`` / ``v`` # [B, kv_heads, S, head_dim] to ``layer``'s entries; returns all of
        them, # [B, kv_heads, length + S, head_dim]."""
        if torch.is_grad_enabled() and (k.requires_grad or v.requires_grad):
            if layer == len(self.buffers):
                self.buffers.append((k, v))
                self.lengths.append(k.shape[-2])
            else:
                keys, values = self.buffers[layer]
                n = self.lengths[layer]
                keys = torch.cat([keys[..., :n, :], k], dim=-2)
                values = torch.cat([values[..., :n, :], v], dim=-2)
                self.buffers[layer], self.lengths[layer] = (keys, values), n + k.shape[-2]
            keys, values = self.buffers[layer]
            return keys[..., : self.lengths[layer], :], values[..., : self.lengths[layer], :]
        keys, values, start = self.reserve(layer, k, v)
        end = start + k.shape[-2]
        keys[..., start:end, :] = k
        values[..., start:end, :] = v
        self.extend(layer, k.shape[-2])
        return keys[..., :end, :], values[..., :end, :]

    def reserve(
        self, layer: int, k_like: torch.Tensor, v_like: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Room for S more entries in ``layer`` (shapes and dtypes as ``k_like`` / ``v_like``
        # [B, kv_heads, S, head_dim]): (key buffer, value buffer, start). The caller writes
        entries [start, start + S), then calls ``extend(layer, S)``."""
        extra = k_like.shape[-2]
        if layer == len(self.buffers):
            capacity = max(MIN_CAPACITY, 2 * extra)
            self.buffers.append((buffer_like(k_like, capacity), buffer_like(v_like, capacity)))
            self.lengths.append(0)
        keys, values = self.buffers[layer]
        start = self.lengths[layer]
        if start + extra > keys.shape[-2]:
            capacity = max(2 * keys.shape[-2], start + extra)
            keys = grown_buffer(keys, start, capacity)
            values = grown_buffer(values, start, capacity)
            self.buffers[layer] = (keys, values)
        return keys, values, start

    def extend(self, layer: int, count: int) -> None:
        """Count ``count`` more entries of ``layer``, written in place after ``reserve``."""
        self.lengths[layer] += count

    def attention(
        self,
        layer: int,
        q: torch.Tensor,  # [B, heads, S, head_dim]
        k: torch.Tensor,  # [B, kv_heads, S, head_dim]
        v: torch.Tensor,
        attend: torch.Tensor,  # [B, 1, S, P + S] bool, True where attention is allowed
    ) -> torch.Tensor:
        """Append this call's keys and values to ``layer``'s, attend over all.
        # [B, heads, S, head_dim]"""
        k, v = self.append(layer, k, v)  # [B, kv_heads, P + S, head_dim]
        return attention(q, k, v, attend)

    def crop(self, length: int) -> None:
        self.lengths = [min(n, length) for n in self.lengths]


class AttentionCache(Protocol):
    """What a head layer attends through: ``EagleCache`` in drafting; training may pass a cache
    that knows the structure of its mask and computes the same attention faster."""

    @property
    def length(self) -> int: ...

    def attention(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attend: torch.Tensor
    ) -> torch.Tensor: ...


def attention(
    q: torch.Tensor,  # [B, heads, S, head_dim]
    k: torch.Tensor,  # [B, kv_heads, P + S, head_dim]
    v: torch.Tensor,
    attend: torch.Tensor,  # [B, 1, S, P + S] bool
) -> torch.Tensor:
    """Masked attention, key/value heads shared by groups of query heads. # [B, heads, S, hd]"""
    grouped = k.shape[1] != q.shape[1]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=attend, enable_gqa=grouped)


@functools.lru_cache(maxsize=16)
def _inverse_frequencies(head_dim: int, theta: float, device: torch.device) -> torch.Tensor:
    """1 / theta^(2i / head_dim) # [head_dim / 2], made once per shape and device (a drafting
    step asks for it at every depth); never written to. A normal tensor even when first asked
    for under inference mode, so that training may use it too."""
    with torch.inference_mode(False):
        return 1.0 / theta ** (
            torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim
        )


def rotary(
    positions: torch.Tensor, head_dim: int, theta: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin for the given positions. positions: # [B, S] -> each # [B, 1, S, head_dim]"""
    inv_freq = _inverse_frequencies(head_dim, float(theta), positions.device)
    angles = positions.float().unsqueeze(-1) * inv_freq  # [B, S, head_dim/2]
    angles = torch.cat([angles, angles], dim=-1).unsqueeze(1)  # [B, 1, S, head_dim]
    return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: # [B, heads, S, head_dim]"""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return (x * cos + rotated * sin).to(x.dtype)


class EagleDecoderLayer(nn.Module):
    def __init__(self, config: HeadsConfig) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.head_dim = hidden // self.num_heads
        self.attn_norm = nn.RMSNorm(hidden, eps=config.norm_eps)
        self.qkv = nn.Linear(hidden, 3 * hidden, bias=False)
        self.out = nn.Linear(hidden, hidden, bias=False)
        self.mlp_norm = nn.RMSNorm(hidden, eps=config.norm_eps)
        self.gate_up = nn.Linear(hidden, 2 * config.mlp_size, bias=False)
        self.down = nn.Linear(config.mlp_size, hidden, bias=False)
        # Zero output projections: an untrained layer passes its input through unchanged.
        nn.init.zeros_(self.out.weight)
        nn.init.zeros_(self.down.weight)

    def forward(
        self,
        x: torch.Tensor,  # [B, S, H]
        rope: tuple[torch.Tensor, torch.Tensor],  # each [B, 1, S, head_dim]
        attend: torch.Tensor,  # [B, 1, S, P + S] bool, True where attention is allowed
        cache: AttentionCache | None,
        layer_index: int,
    ) -> torch.Tensor:
        batch, seq, hidden = x.shape
        q, k, v = self.qkv(self.attn_norm(x)).split(hidden, dim=-1)
        q, k, v = (
            t.view(batch, seq, self.num_heads, self.head_dim).transpose(1, 2) for t in (q, k, v)
        )
        q, k = apply_rotary(q, *rope), apply_rotary(k, *rope)  # [B, heads, S, head_dim]
        if cache is None:
            attn = attention(q, k, v, attend)  # [B, heads, S, head_dim]
        else:
            attn = cache.attention(layer_index, q, k, v, attend)
        x = x + self.out(attn.transpose(1, 2).reshape(batch, seq, hidden))
        gate, up = self.gate_up(self.mlp_norm(x)).chunk(2, dim=-1)
        return x + self.down(F.silu(gate) * up)


@register_heads(HeadKind.EAGLE)
class EagleHead(nn.Module):
    def __init__(self, config: HeadsConfig) -> None:
        super().__init__()
        if config.kind is not HeadKind.EAGLE:
            raise ValueError(f"EagleHead needs kind=eagle, got {config.kind.value}")
        self.config = config
        hidden = config.hidden_size
        self.fuse = nn.Linear(2 * hidden, hidden, bias=True)
        # Start as "next feature = this feature": identity on the feature half, zero elsewhere.
        with torch.no_grad():
            self.fuse.weight.zero_()
            self.fuse.weight[:, hidden:] = torch.eye(hidden)
            self.fuse.bias.zero_()
        self.layers = nn.ModuleList(EagleDecoderLayer(config) for _ in range(config.num_layers))
        register_draft_vocab(self, config)

    def forward(
        self,
        token_embeds: torch.Tensor,  # [B, S, H] target embeddings of token t+1
        features: torch.Tensor,  # [B, S, H] features at position t (target's or predicted)
        positions: torch.Tensor,  # [B, S] positions of token t+1
        attend: torch.Tensor | None = None,  # [B, 1, S, P + S] bool; None = causal over cache+S
        cache: EagleCache | None = None,
    ) -> torch.Tensor:
        """Predicted features at the positions of the input tokens. # [B, S, H]"""
        x = self.fuse(torch.cat([token_embeds, features], dim=-1))
        if attend is None:
            past = 0 if cache is None else cache.length
            attend = causal_attend(x.shape[1], past, x.device)
        rope = rotary(positions, self.layers[0].head_dim, self.config.rope_theta)
        rope = (rope[0].to(x.dtype), rope[1].to(x.dtype))
        for index, layer in enumerate(self.layers):
            x = layer(x, rope, attend, cache, index)
        return x


def causal_attend(seq: int, past: int, device: torch.device) -> torch.Tensor:
    """Every past entry plus a causal block over the new ones. # [1, 1, S, P + S] bool"""
    new = torch.ones(seq, seq, dtype=torch.bool, device=device).tril()
    old = torch.ones(seq, past, dtype=torch.bool, device=device)
    return torch.cat([old, new], dim=-1)[None, None]
