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
kernels are not built, autograd is on, the input is not on the CPU in the dtype of the head's
norms (fp32 or bf16: a bf16 head runs the bf16 layer of ``decoder_layer.cpp``), or any of the
head's modules is not as installed: a hook, or a draft delta active for this request
(``DeltaBank``).

``FusedEagle3Head`` does the same for an EAGLE-3 head's ``midlayer``: the normalised embedding
and feature side by side (2H wide) are the layer's attention input, given to ``decoder_body``
beside the feature, which is its residual stream (a plan with no input norm).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from selfspec.fused_layer import FUSED_DTYPES, hooked
from selfspec.heads.eagle import EagleCache, EagleHead, rotary
from selfspec.heads.eagle3 import Eagle3Head
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
        x, attention_input = self._inputs(token_embeds, features)  # [B, S, H], [B, S, K] or None
        length, layers = x.shape[1], len(self._layers())
        kv_heads, head_dim = self._cache_shape()
        like = x.new_empty(1, kv_heads, length, head_dim)
        reserved = [[c.reserve(index, like, like) for index in range(layers)] for c in caches]
        starts = [own[0][2] for own in reserved]
        masks = [None if attend is None else _additive(attend, x.device) for attend in attends]
        cos, sin = rotary(positions, head_dim, self.head.config.rope_theta)  # [B, 1, S, D]
        cos, sin = cos.to(x.dtype), sin.to(x.dtype)  # fp32 as computed; a bf16 head's dtype
        out = extension.load().decoder_body(
            plan,
            x.contiguous(),
            cos[:, 0].contiguous(),
            sign_folded(sin[:, 0]).contiguous(),
            [own[index][0] for index in range(layers) for own in reserved],  # [layer * B + b]
            [own[index][1] for index in range(layers) for own in reserved],
            starts,
            masks,
            [],  # one segment per row (padded)
            [],
            [],
            [],
            extension.requested_isa(),
            attention_input,
        )[0]
        for c in caches:
            for index in range(layers):
                c.extend(index, length)
        return out

    # -- what differs between head kinds ------------------------------------------------------

    def _layers(self) -> list[nn.Module]:
        return list(self.head.layers)

    def _inputs(
        self, token_embeds: torch.Tensor, features: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The first layer's input stream # [B, S, H], and its attention input if it takes one
        of its own (None: its input norm over the stream)."""
        return self.head.fuse(torch.cat([token_embeds, features], dim=-1)), None

    def _cache_shape(self) -> tuple[int, int]:
        """(key/value heads, head dim) of the head's cache entries."""
        layer = self.head.layers[0]
        return layer.num_heads, layer.head_dim

    @staticmethod
    def _modules_of(layer: nn.Module) -> tuple[list[nn.Module], list[nn.Module]]:
        """A layer's norms and linear layers, as its plan reads them."""
        return [layer.attn_norm, layer.mlp_norm], [layer.qkv, layer.out, layer.gate_up, layer.down]

    @staticmethod
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

    def _current_plan(self, features: torch.Tensor):
        """The C++ plan of the head's layers, remade when a weight changed; None where the
        fused path cannot run now (see the module's docstring)."""
        if (
            features.dtype not in FUSED_DTYPES
            or features.device.type != "cpu"
            or torch.is_grad_enabled()
            or extension.load() is None
        ):
            return None
        weights, norms = [], []
        for layer in self._layers():
            layer_norms, linears = self._modules_of(layer)
            if hooked(layer, *layer_norms, *linears):
                return None
            found = [_kernel_weight(linear) for linear in linears]
            if any(weight is None for weight in found):
                return None
            weights.append(found)
            norms += [norm.weight for norm in layer_norms]
        if any(norm.dtype != features.dtype for norm in norms):
            return None  # the plan computes in its norms' dtype
        # A kernel weight is remade whenever its layer's weight changes (KernelLinear), so its
        # identity says whether the plan is current; the plan holds them, so ids stay unique.
        key = [id(w) for layer in weights for w in layer] + [
            (n.data_ptr(), n._version) for n in norms
        ]
        if key != self._plan_key:
            module = extension.load()
            plans = [
                self._layer_plan(module, layer, found)
                for layer, found in zip(self._layers(), weights, strict=True)
            ]
            self._plan = module.BodyPlan(plans)
            self._plan_key, self._plan_weights = key, weights
        return self._plan


class FusedEagle3Head(FusedEagleHead):
    """An EAGLE-3 head's forward through the kernels (see the module's docstring)."""

    def __init__(self, head: Eagle3Head) -> None:
        super().__init__(head)  # type: ignore[arg-type]

    def _layers(self) -> list[nn.Module]:
        return [self.head.midlayer]

    def _inputs(
        self, token_embeds: torch.Tensor, features: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        layer = self.head.midlayer
        joined = torch.cat([layer.input_layernorm(token_embeds), layer.hidden_norm(features)], -1)
        return features, joined  # [B, S, H] the residual stream, [B, S, 2H] attention's input

    def _cache_shape(self) -> tuple[int, int]:
        attention = self.head.midlayer.self_attn
        return attention.kv_heads, attention.head_dim

    @staticmethod
    def _modules_of(layer: nn.Module) -> tuple[list[nn.Module], list[nn.Module]]:
        attention, mlp = layer.self_attn, layer.mlp
        norms = [layer.input_layernorm, layer.hidden_norm, layer.post_attention_layernorm]
        linears = [attention.q_proj, attention.k_proj, attention.v_proj, attention.o_proj]
        return norms, [*linears, mlp.gate_proj, mlp.up_proj, mlp.down_proj]

    @staticmethod
    def _layer_plan(module, layer: nn.Module, weights: list[KernelWeight]):
        """The ``midlayer``'s plan: no input norm (its attention input is given), q/k/v 2H wide."""
        attention = layer.self_attn
        return module.DecoderLayerPlan(
            torch.empty(0),
            0.0,
            layer.post_attention_layernorm.weight.detach(),
            _eps(layer.post_attention_layernorm),
            [_rows(module, weight, 0, weight.out_features) for weight in weights],
            attention.num_heads,
            attention.kv_heads,
            attention.head_dim,
            1.0 / math.sqrt(attention.head_dim),
        )


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
    """A ``KernelMatrix`` over output rows [start, stop) of ``weight`` (``output_rows``)."""
    rows = weight.output_rows(start, stop)
    return module.KernelMatrix(
        rows.code,
        rows.data,
        rows.scale,
        rows.minimum,
        None,
        rows.group or rows.in_features,
        rows.out_features,
    )


def _eps(norm: nn.RMSNorm) -> float:
    return norm.eps if norm.eps is not None else torch.finfo(torch.float32).eps
