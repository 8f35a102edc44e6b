"""The draft vocabulary: which token ids the heads may propose.

Drafting projects every draft depth through the target's lm_head; on a small model with a large
vocabulary that projection dominates the draft's cost (SmolLM2-135M: 49152 x 576 of its 135M
weights). Heads trained with a restricted loss vocabulary only ever learnt to rank those tokens,
so drafting over them alone loses little and costs a fraction. Verification is untouched.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn

from selfspec.heads.config import HeadKind, HeadsConfig

BUFFER = "draft_vocab"


def register_draft_vocab(module: nn.Module, config: HeadsConfig) -> None:
    """Give heads a ``draft_vocab`` buffer (# [N] token ids, ascending) when N > 0; it is saved
    with the weights. Initialised to the first N ids; training or loading sets the real ones."""
    if config.draft_vocab_size:
        module.register_buffer(BUFFER, torch.arange(config.draft_vocab_size), persistent=True)


def draft_vocab_of(heads: nn.Module) -> torch.Tensor | None:
    """# [N] token ids the heads draft from, or None for the whole vocabulary."""
    return getattr(heads, BUFFER, None)


def set_draft_vocab(heads: nn.Module, token_ids: torch.Tensor) -> None:
    """Install the draft vocabulary (validated, stored ascending)."""
    current = draft_vocab_of(heads)
    if current is None:
        raise ValueError("these heads were built without a draft vocabulary (draft_vocab_size=0)")
    ids = check_draft_vocab(token_ids, heads.config.vocab_size, int(current.shape[0]))
    current.copy_(ids.to(current.device))


def check_draft_vocab(token_ids: torch.Tensor, vocab_size: int, size: int) -> torch.Tensor:
    """Ascending, unique, in-range integer ids, exactly ``size`` of them; else ValueError."""
    if token_ids.dtype.is_floating_point or token_ids.dim() != 1:
        raise ValueError(
            f"draft_vocab must be a 1-D integer tensor, got {token_ids.dtype} "
            f"of shape {tuple(token_ids.shape)}"
        )
    if token_ids.shape[0] != size:
        raise ValueError(f"draft_vocab holds {token_ids.shape[0]} ids, expected {size}")
    ids = token_ids.long().sort().values
    if size and (int(ids[0]) < 0 or int(ids[-1]) >= vocab_size):
        raise ValueError(f"draft_vocab ids must lie in [0, {vocab_size})")
    if size > 1 and not bool((ids[1:] > ids[:-1]).all()):
        raise ValueError("draft_vocab ids must be unique")
    return ids


def with_draft_vocab(heads: nn.Module, token_ids: torch.Tensor | None) -> nn.Module:
    """The same heads drafting from ``token_ids`` (None: the whole vocabulary); rebuilt with the
    matching ``draft_vocab_size``, weights copied, when the size differs.

    Medusa and EAGLE only: EAGLE-3 heads carry their own lm_head over their draft vocabulary
    (see ``selfspec.heads.eagle3.with_eagle3_draft_vocab``)."""
    if heads.config.kind is HeadKind.EAGLE3:
        raise ValueError(
            "EAGLE-3 heads have their own lm_head over the draft vocabulary they were trained "
            "on; it cannot be swapped afterwards (train with loss_vocab_size instead)"
        )
    size = 0 if token_ids is None else int(token_ids.shape[0])
    if heads.config.draft_vocab_size != size:
        rebuilt = type(heads)(replace(heads.config, draft_vocab_size=size))
        weights = {k: v for k, v in heads.state_dict().items() if k != BUFFER}
        rebuilt.load_state_dict({**rebuilt.state_dict(), **weights})
        rebuilt.train(heads.training)
        # Built in float32 on the CPU; the weights go where the given heads were, as they were
        # (bfloat16 on a GPU, say).
        first = next(heads.parameters())
        heads = rebuilt.to(device=first.device, dtype=first.dtype)
    if token_ids is not None:
        set_draft_vocab(heads, token_ids)
    return heads
