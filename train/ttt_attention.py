"""The attention of EAGLE-3's training-time test, computed from the structure of its mask.

Unrolled step s (see ``eagle3_loss``) has queries at W positions; query j may see step 1's keys
0..j (causal) and, of every later step 2..s, only its own chain's key j (a diagonal). Handed to
the head as its cache, ``UnrolledKV`` computes exactly the attention that the dense mask
``unrolled_attend(W, s)`` over all s*W keys gives, at the cost of one causal W x W block plus
s-1 dot products per query instead of s*W: 28 W^2 -> 7 W^2 (+ 7 W) score entries over 7 steps.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


class UnrolledKV:
    """Keys and values of the unrolled steps, one head layer; step 1's first, then one per step."""

    def __init__(self) -> None:
        self.keys: list[torch.Tensor] = []  # each [B, kv_heads, W, head_dim]
        self.values: list[torch.Tensor] = []

    @property
    def length(self) -> int:
        return sum(int(k.shape[-2]) for k in self.keys)

    def attention(
        self,
        layer: int,
        q: torch.Tensor,  # [B, heads, W, head_dim]
        k: torch.Tensor,  # [B, kv_heads, W, head_dim]
        v: torch.Tensor,
        attend: torch.Tensor,  # the dense mask; its structure is what this class computes
    ) -> torch.Tensor:
        """This step's attention output. # [B, heads, W, head_dim]"""
        if layer != 0:
            raise ValueError("the training-time test unrolls a one-layer head")
        self.keys.append(k)
        self.values.append(v)
        grouped = k.shape[1] != q.shape[1]
        if len(self.keys) == 1:  # step 1: causal over its own entries
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=grouped)
        return self._unrolled(q)

    def _unrolled(self, q: torch.Tensor) -> torch.Tensor:
        batch, heads, width, dim = q.shape
        kv_heads = self.keys[0].shape[1]
        group = heads // kv_heads
        scale = dim**-0.5
        # Query heads grouped under their key/value head: # [B, kv, g, W, d]
        grouped = q.reshape(batch, kv_heads, group, width, dim)
        first_k, first_v = self.keys[0], self.values[0]  # [B, kv, W, d]
        causal = grouped.reshape(batch, kv_heads, group * width, dim) @ first_k.transpose(-1, -2)
        causal = causal.view(batch, kv_heads, group, width, width) * scale  # [B, kv, g, W, W]
        seen = torch.ones(width, width, dtype=torch.bool, device=q.device).tril()
        causal = causal.masked_fill(~seen, float("-inf"))
        # Query j against its own chain's key j at steps 2..s, as a batched product per position:
        across = grouped.transpose(2, 3)  # [B, kv, W, g, d]
        chain_k = torch.stack(self.keys[1:], dim=-1)  # [B, kv, W, d, s-1]
        diagonal = (across @ chain_k).transpose(2, 3) * scale  # [B, kv, g, W, s-1]
        probs = torch.cat([causal, diagonal], dim=-1).softmax(-1, dtype=torch.float32)
        probs = probs.to(first_v.dtype)  # [B, kv, g, W, W + s-1]
        out = probs[..., :width].reshape(batch, kv_heads, group * width, width) @ first_v
        chain_v = torch.stack(self.values[1:], dim=-2)  # [B, kv, W, s-1, d]
        chain_out = probs[..., width:].transpose(2, 3) @ chain_v  # [B, kv, W, g, d]
        out = out.view(batch, kv_heads, group, width, dim) + chain_out.transpose(2, 3)
        return out.reshape(batch, heads, width, dim)
