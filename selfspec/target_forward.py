"""The target as the decoding loop sees it: features from the body, logits from its lm_head.

Running the decoder body and the ``lm_head`` separately (both public: ``get_decoder``,
``get_output_embeddings``) gives the feature the heads build on, and lets prefill skip the
vocabulary projection for every prompt position but the last. Where ``selfspec.lean_body``
covers the body and the call, it runs the body: the same bits, without transformers' per-layer
Python.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn
from transformers import DynamicCache, PreTrainedModel

from selfspec.growing_cache import growing_cache, supports_growing
from selfspec.lean_body import LeanBody, unsupported_reason


class TargetForward:
    """Thin view of an HF causal LM (optionally peft-wrapped). Holds no per-request state.

    ``lean``: run the body through ``LeanBody`` where it is supported (bit-identical results);
    False always calls the HF body (benchmarks compare the two). ``fixed_order_attention``:
    see ``LeanBody``."""

    def __init__(
        self,
        model: PreTrainedModel,
        lean: bool = True,
        fixed_order_attention: bool | None = None,
    ) -> None:
        self.model = model
        self._growing: bool | None = None
        self.body: nn.Module = model.get_decoder()
        self.lean: LeanBody | None = (
            LeanBody(self.body, fixed_order_attention)
            if lean and unsupported_reason(self.body) is None
            else None
        )
        self.lm_head: nn.Module = model.get_output_embeddings()
        self.embed: nn.Module = model.get_input_embeddings()
        if self.lm_head is None or self.embed is None:
            raise TypeError(f"{type(model).__name__} has no input/output embeddings to share")

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.embed.weight.device

    @property
    def hidden_size(self) -> int:
        return int(self.embed.weight.shape[1])

    @property
    def vocab_size(self) -> int:
        return int(self.lm_head.weight.shape[0])

    def new_cache(self) -> DynamicCache:
        """An empty KV cache; its layers append in place (``selfspec.growing_cache``) where every
        layer is full attention."""
        config = self.model.config
        if self._growing is None:
            self._growing = supports_growing(config)
        return growing_cache(config) if self._growing else DynamicCache(config=config)

    def features(
        self,
        input_ids: torch.Tensor,  # [B, S]
        position_ids: torch.Tensor,  # [B, S]
        cache: DynamicCache,
        attention_mask: torch.Tensor | None = None,  # [B, 1, S, cache + S] or None (causal)
    ) -> torch.Tensor:
        """Last hidden state (the lm_head's input), appending S entries to the cache. # [B, S, H]"""
        if self.lean is not None and self.lean.covers(input_ids, cache, attention_mask):
            return self.lean(input_ids, position_ids, cache, attention_mask)
        out = self.body(
            input_ids=input_ids,
            position_ids=position_ids,
            attention_mask=attention_mask,
            cache=cache,
            use_cache=True,
        )
        return out.last_hidden_state

    def whole_body_runs(self) -> bool:
        """Whether ``features_rows`` would run as the model's modules and hooks stand now (the
        kernels' whole body; not with peft's adapter layers or a foreign hook)."""
        lean = self.lean
        if lean is None or lean.fused_body is None or not lean.fused_glue:
            return False
        probe = torch.empty(1, 1, self.hidden_size, dtype=self.dtype, device=self.device)
        return lean.fused_body.check(probe) is not None

    def features_rows(
        self,
        input_ids: torch.Tensor,  # [1, N]
        position_ids: torch.Tensor,  # [1, N]
        caches: Sequence[DynamicCache],  # one per row, each of batch 1
        lengths: Sequence[int],  # tokens of each row, back to back: sum N
        masks: Sequence[torch.Tensor],  # [1, lengths[g], cache_g + lengths[g]] additive
    ) -> torch.Tensor | None:
        """Last hidden states # [1, N, H] of rows with their own caches, back to back, in one
        forward that copies no cache (``LeanBody.rows_forward``); None where that cannot run."""
        if self.lean is None:
            return None
        return self.lean.rows_forward(input_ids, position_ids, caches, lengths, masks)

    def logits(self, features: torch.Tensor) -> torch.Tensor:
        """# [..., H] -> [..., vocab]"""
        return self.lm_head(features)
