"""The target's distributions as labels, computed once and scored against many draft steps.

EAGLE-3's training-time test scores every unrolled step against the target's distribution at
the step's positions: a subset of the same labelled positions each time. ``SoftLabels`` turns the
target's logits into probabilities, entropies and argmaxes once; ``kl`` scores a step with a fused
soft cross-entropy whose backward is ``softmax(draft) - p`` in one pass (autograd through
``log_softmax`` and ``kl_div`` makes ~12 passes over the # [M, vocab] arrays, which on a CPU cost
more than the head itself).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class SoftLabels:
    """Labels of M positions over a vocabulary of N (the draft vocabulary)."""

    probs: torch.Tensor  # [M, N] float32, the target's distribution
    entropy: torch.Tensor  # [M] float32, its entropy (KL = cross-entropy - entropy)
    tokens: torch.Tensor  # [M] its most likely token

    @classmethod
    def from_logits(cls, logits: torch.Tensor) -> SoftLabels:
        """# [M, N] target logits (no grad)."""
        with torch.no_grad():
            log_probs = F.log_softmax(logits.float(), dim=-1)
            probs = log_probs.exp()
            entropy = -(probs * log_probs).sum(-1)
        return cls(probs=probs, entropy=entropy, tokens=logits.argmax(-1))

    def kl(self, draft_logits: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
        """Mean over ``rows`` of KL(target || draft). draft_logits # [M_s, N], rows # [M_s];
        None: all M rows in order (no copy of the # [M, N] probabilities)."""
        probs, entropy = self.probs, self.entropy
        if rows is not None:
            probs, entropy = probs[rows], entropy[rows]
        return (SoftCrossEntropy.apply(draft_logits, probs) - entropy).mean()


class SoftCrossEntropy(torch.autograd.Function):
    """-sum_v p_v log softmax(z)_v per row = logsumexp(z) - p.z (p sums to 1). # [M, N] -> [M]"""

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
        z = logits.float()
        lse = torch.logsumexp(z, dim=-1)  # [M]
        ctx.save_for_backward(z, probs, lse)
        ctx.logits_dtype = logits.dtype
        return lse - (probs * z).sum(-1)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        z, probs, lse = ctx.saved_tensors
        softmax = (z - lse[:, None]).exp_()  # z may be the caller's logits: not in place
        return softmax.sub_(probs).mul_(grad[:, None]).to(ctx.logits_dtype), None
