"""EAGLE-3 head: fused target features, one decoder layer, its own lm_head over a draft vocabulary.

The target's hidden states at a few layers (``config.target_layers``, low/mid/high) are
concatenated and projected to the hidden size by ``fc``: the fused feature g. Input at position
t+1 is ``[norm(embed(token_{t+1})); norm(feature_t)]`` (2H wide into q/k/v, as in EAGLE-3) with
the target's own embedding table; feature_t is g_t for committed positions and the head's own
output (its pre-norm hidden state) deeper in a draft, which is what the training-time test trains
for. The output h_{t+1} gives draft logits ``lm_head(norm(h_{t+1}))`` over the draft vocabulary
for token t+2, and is the next step's feature.

Tensor names follow the published EAGLE-3 drafters (SpecForge, the ``speculators`` format that
vLLM and SGLang load): ``fc``, ``midlayer.{input_layernorm, hidden_norm, self_attn.{q,k,v,o}_proj,
post_attention_layernorm, mlp.{gate,up,down}_proj}``, ``norm``, ``lm_head``, ``d2t`` (draft index
-> target id offset: id = index + d2t[index]) and ``t2d`` (target id -> in the draft vocabulary),
so an export to that format is a renaming of the config, not of the weights.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from selfspec.heads.config import HeadKind, HeadsConfig
from selfspec.heads.draft_vocab import check_draft_vocab
from selfspec.heads.eagle import (
    AttentionCache,
    apply_rotary,
    attention,
    causal_attend,
    rotary,
)
from selfspec.heads.registry import register_heads


class Eagle3Attention(nn.Module):
    """Rotary attention with grouped key/value heads whose q/k/v read the 2H-wide input."""

    def __init__(self, config: HeadsConfig) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.num_heads, self.kv_heads = config.num_attention_heads, config.kv_heads
        self.head_dim = hidden // self.num_heads
        self.q_proj = nn.Linear(2 * hidden, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(2 * hidden, self.kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(2 * hidden, self.kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, hidden, bias=False)

    def forward(
        self,
        x: torch.Tensor,  # [B, S, 2H]
        rope: tuple[torch.Tensor, torch.Tensor],  # each [B, 1, S, head_dim]
        attend: torch.Tensor,  # [B, 1, S, P + S] bool, True where attention is allowed
        cache: AttentionCache | None,
    ) -> torch.Tensor:
        batch, seq, _ = x.shape
        q = self.q_proj(x).view(batch, seq, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(batch, seq, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(batch, seq, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rotary(q, *rope), apply_rotary(k, *rope)  # [B, heads, S, head_dim]
        # [B, heads, S, head_dim]
        attn = attention(q, k, v, attend) if cache is None else cache.attention(0, q, k, v, attend)
        return self.o_proj(attn.transpose(1, 2).reshape(batch, seq, -1))  # [B, S, H]


class Eagle3MLP(nn.Module):
    def __init__(self, config: HeadsConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.mlp_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.mlp_size, bias=False)
        self.down_proj = nn.Linear(config.mlp_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Eagle3DecoderLayer(nn.Module):
    """The ``midlayer``: the residual stream is the feature; the token embedding joins it only
    inside attention (q/k/v read both, normalised separately)."""

    def __init__(self, config: HeadsConfig) -> None:
        super().__init__()
        hidden, eps = config.hidden_size, config.norm_eps
        self.input_layernorm = nn.RMSNorm(hidden, eps=eps)  # on the token embedding
        self.hidden_norm = nn.RMSNorm(hidden, eps=eps)  # on the feature
        self.self_attn = Eagle3Attention(config)
        self.post_attention_layernorm = nn.RMSNorm(hidden, eps=eps)
        self.mlp = Eagle3MLP(config)
        # Zero output projections: an untrained layer passes its feature through unchanged.
        nn.init.zeros_(self.self_attn.o_proj.weight)
        nn.init.zeros_(self.mlp.down_proj.weight)

    def forward(
        self,
        token_embeds: torch.Tensor,  # [B, S, H]
        features: torch.Tensor,  # [B, S, H]
        rope: tuple[torch.Tensor, torch.Tensor],
        attend: torch.Tensor,  # [B, 1, S, P + S] bool
        cache: AttentionCache | None,
    ) -> torch.Tensor:
        joined = torch.cat([self.input_layernorm(token_embeds), self.hidden_norm(features)], -1)
        x = features + self.self_attn(joined, rope, attend, cache)  # [B, S, H]
        return x + self.mlp(self.post_attention_layernorm(x))


@register_heads(HeadKind.EAGLE3)
class Eagle3Head(nn.Module):
    def __init__(self, config: HeadsConfig) -> None:
        super().__init__()
        if config.kind is not HeadKind.EAGLE3:
            raise ValueError(f"Eagle3Head needs kind=eagle3, got {config.kind.value}")
        self.config = config
        hidden, fused = config.hidden_size, len(config.target_layers)
        self.fc = nn.Linear(fused * hidden, hidden, bias=False)
        # Start from the highest fused layer's state (identity on its block, zero elsewhere).
        with torch.no_grad():
            self.fc.weight.zero_()
            self.fc.weight[:, (fused - 1) * hidden :] = torch.eye(hidden)
        self.midlayer = Eagle3DecoderLayer(config)
        self.norm = nn.RMSNorm(hidden, eps=config.norm_eps)
        self.lm_head = nn.Linear(hidden, config.draft_rows, bias=False)
        rows = config.draft_rows
        self.register_buffer("d2t", torch.zeros(rows, dtype=torch.long), persistent=True)
        self.register_buffer(
            "t2d", torch.ones(config.vocab_size, dtype=torch.bool), persistent=True
        )
        if config.draft_vocab_size:  # the first N ids until training or loading sets the real ones
            self.set_draft_ids(torch.arange(rows))

    # -- the draft vocabulary ------------------------------------------------------------------

    @property
    def draft_vocab(self) -> torch.Tensor | None:
        """# [N] target token ids of the lm_head's rows, ascending; None: the whole vocabulary."""
        if not self.config.draft_vocab_size:
            return None
        return torch.arange(self.d2t.shape[0], device=self.d2t.device) + self.d2t

    def set_draft_ids(self, token_ids: torch.Tensor) -> None:
        """Install the maps for draft rows ``token_ids`` (# [N], validated, stored ascending)."""
        ids = check_draft_vocab(token_ids, self.config.vocab_size, self.config.draft_rows)
        ids = ids.to(self.d2t.device)
        self.d2t.copy_(ids - torch.arange(ids.shape[0], device=ids.device))
        self.t2d.zero_()
        self.t2d[ids] = True

    @staticmethod
    def check_state(state: dict[str, torch.Tensor], config: HeadsConfig) -> None:
        """A loaded state's d2t / t2d describe one valid draft vocabulary; else ValueError."""
        d2t, t2d = state["d2t"], state["t2d"]
        if d2t.dtype != torch.long or t2d.dtype != torch.bool:
            raise ValueError(f"d2t must be int64 and t2d bool, got {d2t.dtype} and {t2d.dtype}")
        raw = torch.arange(d2t.shape[0]) + d2t  # [N] token id of each draft row
        ids = check_draft_vocab(raw, config.vocab_size, config.draft_rows)
        if not torch.equal(raw, ids):
            raise ValueError("d2t must map the draft rows to ascending token ids")
        if not torch.equal(t2d.nonzero().flatten(), ids):
            raise ValueError("t2d does not mark exactly the token ids that d2t maps to")

    # -- the forward ---------------------------------------------------------------------------

    def fuse(self, layer_states: torch.Tensor) -> torch.Tensor:
        """The target's states at ``target_layers``, concatenated in order, projected.
        # [..., len(target_layers) * H] -> [..., H]"""
        return self.fc(layer_states)

    def forward(
        self,
        token_embeds: torch.Tensor,  # [B, S, H] target embeddings of token t+1
        features: torch.Tensor,  # [B, S, H] fused feature at t, or the head's own output at t
        positions: torch.Tensor,  # [B, S] positions of token t+1
        attend: torch.Tensor | None = None,  # [B, 1, S, P + S] bool; None = causal over cache+S
        cache: AttentionCache | None = None,
    ) -> torch.Tensor:
        """The head's hidden state at the input tokens' positions (pre-norm; the next step's
        feature). # [B, S, H]"""
        if attend is None:
            past = 0 if cache is None else cache.length
            attend = causal_attend(features.shape[1], past, features.device)
        head_dim = self.midlayer.self_attn.head_dim
        cos, sin = rotary(positions, head_dim, self.config.rope_theta)
        rope = (cos.to(features.dtype), sin.to(features.dtype))
        return self.midlayer(token_embeds, features, rope, attend, cache)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Draft logits over the draft vocabulary. # [..., H] -> [..., N]"""
        return self.lm_head(self.norm(hidden))


def init_from_target(head: Eagle3Head, lm_head: nn.Module, final_norm: nn.Module | None) -> None:
    """Initialise a new head's lm_head with the target's lm_head rows of its draft vocabulary
    and its ``norm`` with the target's final norm weight (when it has an RMSNorm-like one)."""
    ids = head.draft_vocab
    weight = lm_head.weight.detach()  # [vocab, H]
    with torch.no_grad():
        rows = weight if ids is None else weight[ids.to(weight.device)]
        head.lm_head.weight.copy_(rows.to(head.lm_head.weight))  # [N, H]
        norm_weight = getattr(final_norm, "weight", None)
        if norm_weight is not None and norm_weight.shape == head.norm.weight.shape:
            head.norm.weight.copy_(norm_weight.detach().to(head.norm.weight))


def with_eagle3_draft_vocab(
    head: Eagle3Head,
    token_ids: torch.Tensor | None,  # [N] token ids, or None for the whole vocabulary
    lm_head: nn.Module,
    final_norm: nn.Module | None = None,
) -> Eagle3Head:
    """Untrained heads rebuilt to draft from ``token_ids``: every other weight kept, the lm_head
    rows taken from the target's lm_head (``init_from_target``)."""
    size = 0 if token_ids is None else int(token_ids.shape[0])
    if size == head.config.vocab_size:
        size, token_ids = 0, None  # the whole vocabulary: identity maps
    rebuilt = Eagle3Head(replace(head.config, draft_vocab_size=size))
    kept = {k: v for k, v in head.state_dict().items() if k not in ("lm_head.weight", "d2t", "t2d")}
    state: dict[str, Any] = {**rebuilt.state_dict(), **kept}
    rebuilt.load_state_dict(state)
    if token_ids is not None:
        rebuilt.set_draft_ids(token_ids)
    init_from_target(rebuilt, lm_head, final_norm)
    rebuilt.to(head.fc.weight.device).train(head.training)
    return rebuilt
