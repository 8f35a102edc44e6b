"""An EAGLE head's decoder layer(s) as one C++ call, as the target's body runs (``decoder_body``).

A drafting step runs the head on a handful of rows (the accepted path in ``advance``, a tree
depth in ``draft``); as ~25 torch ops and module calls a head forward took ~1.7 ms on
SmolLM2-135M's head (AVX-512 EPYC, 1 thread, the other core busy), four times one of the
target's fused layers. Where the head's linear layers run on the kernels
(``selfspec.drafting.head_kernels``), ``FusedEagleHead`` runs its ``fuse`` projection in torch
and its layers through ``decoder_body``: the same kernels as the target's body, the fused
q/k/v and gate/up weights read as row ranges of the head's own kernel weights (no copy), keys
and values written in place into the request's ``EagleCache`` buffers.

It computes the head's function with the kernels' own norm, rotary and fixed-order attention,
so its bits differ from the torch path's: drafts only propose tokens (verification decides every
output), and a request uses one path throughout. It stands aside (the torch path runs) when the
kernels are not built, autograd is on, the input is not fp32 on the CPU, or any of the head's
modules is not as installed: a hook, or a draft delta active for this request (``DeltaBank``).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from selfspec.fused_layer import hooked
from selfspec.heads.eagle import EagleCache, EagleHead, rotary
from selfspec.kernels import extension
from selfspec.kernels.modules import KernelLinear
from selfspec.kernels.weights import KernelWeight
from selfspec.lean_body import sign_folded


class FusedEagleHead:
    """``head``'s forward (same arguments, same result up to rounding) through the kernels."""

    def __init__(self, head: EagleHead) -> None:
        self.head = head
        self._plan = None
        self._plan_key: list | None = None
        self._plan_weights: list = []  # held: the ids in the key stay theirs

    def __call__(
        self,
        token_embeds: torch.Tensor,  # [1, S, H]
        features: torch.Tensor,  # [1, S, H]
        positions: torch.Tensor,  # [1, S]
        attend: torch.Tensor | None,  # [1, 1, S, P + S] bool; None: causal over cache + S
        cache: EagleCache,
    ) -> torch.Tensor:
        """Predicted features # [1, S, H]; the cache gets S entries per layer."""
        out = self.rows(token_embeds, features, positions, [attend], [cache])
        if out is None:
            return self.head(token_embeds, features, positions, attend, cache)
        return out

    def rows(
        self,
        token_embeds: torch.Tensor,  # [B, S, H]
        features: torch.Tensor,  # [B, S, H]
        positions: torch.Tensor,  # [B, S]
        attends: list[torch.Tensor | None],  # B of [1, 1, S, P_b + S] bool; None: causal
        caches: list[EagleCache],  # row b's own cache (P_b entries)
    ) -> torch.Tensor | None:
        """Row b's predicted features over its own cache, all rows in one C++ call # [B, S, H];
        each cache gets S entries per layer. None where the fused path cannot run now (nothing
        was written): the caller runs the head itself."""
        plan = self._current_plan(features)
        if plan is None or any(c.lengths and len(set(c.lengths)) != 1 for c in caches):
            return None
        head = self.head
        x = head.fuse(torch.cat([token_embeds, features], dim=-1))  # [B, S, H]
        length, layers = x.shape[1], len(head.layers)
        layer0 = head.layers[0]
        like = x.new_empty(1, layer0.num_heads, length, layer0.head_dim)
        reserved = [[c.reserve(index, like, like) for index in range(layers)] for c in caches]
        starts = [own[0][2] for own in reserved]
        masks = [None if attend is None else _additive(attend, x.device) for attend in attends]
        cos, sin = rotary(positions, layer0.head_dim, head.config.rope_theta)  # [B, 1, S, D]
        out = extension.load().decoder_body(
            plan,
            x.contiguous(),
            cos[:, 0].contiguous(),
            sign_folded(sin[:, 0]).contiguous(),
            [own[index][0] for index in range(layers) for own in reserved],  # [layer * B + b]
            [own[index][1] for index in range(layers) for own in reserved],
            starts,
            masks,
            [],
            [],
            [],
            extension.requested_isa(),
        )[0]
        for c in caches:
            for index in range(layers):
                c.extend(index, length)
        return out

    def _current_plan(self, features: torch.Tensor):
        """The C++ plan of the head's layers, remade when a weight changed; None where the
        fused path cannot run now (see the module's docstring)."""
        if (
            features.dtype != torch.float32
            or features.device.type != "cpu"
            or torch.is_grad_enabled()
            or extension.load() is None
        ):
            return None
        head = self.head
        weights = []
        for layer in head.layers:
            linears = (layer.qkv, layer.out, layer.gate_up, layer.down)
            if hooked(layer, layer.attn_norm, layer.mlp_norm, *linears):
                return None
            found = [_kernel_weight(linear) for linear in linears]
            if any(weight is None for weight in found):
                return None
            weights.append(found)
        norms = [norm.weight for layer in head.layers for norm in (layer.attn_norm, layer.mlp_norm)]
        # A kernel weight is remade whenever its layer's weight changes (KernelLinear), so its
        # identity says whether the plan is current; the plan holds them, so ids stay unique.
        key = [id(w) for layer in weights for w in layer] + [
            (n.data_ptr(), n._version) for n in norms
        ]
        if key != self._plan_key:
            module = extension.load()
            plans = [
                _layer_plan(module, layer, found)
                for layer, found in zip(head.layers, weights, strict=True)
            ]
            self._plan = module.BodyPlan(plans)
            self._plan_key, self._plan_weights = key, weights
        return self._plan


def _additive(attend: torch.Tensor, device: torch.device) -> torch.Tensor:
    """[1, 1, S, P + S] bool -> [1, S, P + S] additive (0 where allowed, -inf elsewhere)."""
    allowed = attend[0].to(device=device)
    mask = torch.zeros(allowed.shape, dtype=torch.float32, device=device)
    return mask.masked_fill_(~allowed, -math.inf)


def _kernel_weight(linear: nn.Module) -> KernelWeight | None:
    """The kernel weight a head linear layer computes with now, or None if it adds anything
    (a draft delta active for this request) or is not on the kernels."""
    base = getattr(linear, "base", None)  # a DeltaBank's BankedLinear
    if base is not None:
        if linear.pairs.get(linear._bank.current) is not None or hooked(base):
            return None
        linear = base
    if type(linear) is not KernelLinear or linear.bias is not None:
        return None
    return linear.kernel_weight()


def _rows(module, weight: KernelWeight, start: int, stop: int):
    """A ``KernelMatrix`` over output rows [start, stop) of ``weight`` (views, no copy)."""
    return module.KernelMatrix(
        weight.code,
        weight.data[start:stop],
        None if weight.scale is None else weight.scale[start:stop],
        None if weight.minimum is None else weight.minimum[start:stop],
        None,
        weight.group or weight.in_features,
    )


def _layer_plan(module, layer: nn.Module, weights: list[KernelWeight]):
    """A ``DecoderLayerPlan`` of one EAGLE layer: q/k/v and gate/up split out of the fused
    weights (all heads are key/value heads)."""
    qkv, out, gate_up, down = weights
    hidden, mlp = out.out_features, down.in_features
    head_dim = layer.head_dim
    return module.DecoderLayerPlan(
        layer.attn_norm.weight.detach(),
        _eps(layer.attn_norm),
        layer.mlp_norm.weight.detach(),
        _eps(layer.mlp_norm),
        [
            _rows(module, qkv, 0, hidden),
            _rows(module, qkv, hidden, 2 * hidden),
            _rows(module, qkv, 2 * hidden, 3 * hidden),
            _rows(module, out, 0, hidden),
            _rows(module, gate_up, 0, mlp),
            _rows(module, gate_up, mlp, 2 * mlp),
            _rows(module, down, 0, hidden),
        ],
        layer.num_heads,
        layer.num_heads,
        head_dim,
        1.0 / math.sqrt(head_dim),
    )


def _eps(norm: nn.RMSNorm) -> float:
    return norm.eps if norm.eps is not None else torch.finfo(torch.float32).eps
