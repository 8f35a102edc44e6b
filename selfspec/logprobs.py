"""Log-probabilities of the tokens a request commits, from the target's own logits.

The target (with the request's adapter) scores every committed token at the position before it:
in a speculative step that is the verification forward's row of the token's parent on the
accepted path, in vanilla decoding the previous step's single row. The values are
``log_softmax`` of the raw logits (before temperature or top-k/top-p), as vLLM reports by
default, so they do not depend on the sampling settings; with the row-invariant kernels a row's
logits are the same bits whatever else shares its forward, so speculation on or off gives the
same log-probabilities, not only the same tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

MAX_TOP_LOGPROBS = 20
"""Most alternatives per token (OpenAI's limit for chat ``top_logprobs``)."""


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()
    """The ``k`` most likely tokens at this position and their log-probabilities, best first."""


def token_logprobs(
    logits: torch.Tensor,  # [A, vocab] the rows that chose the tokens
    tokens: torch.Tensor,  # [A] the chosen tokens
    top: int,
) -> list[TokenLogprob]:
    """Each token's log-probability under its row, with the row's ``top`` best alternatives."""
    if not 0 <= top <= MAX_TOP_LOGPROBS:
        raise ValueError(f"top logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {top}")
    log_probs = torch.log_softmax(logits.float(), dim=-1)  # [A, vocab]
    chosen = log_probs.gather(-1, tokens.view(-1, 1).to(log_probs.device))[:, 0].tolist()
    best_values: list[list[float]] = [[] for _ in chosen]
    best_ids: list[list[int]] = [[] for _ in chosen]
    if top:
        values, ids = log_probs.topk(top, dim=-1)  # [A, top]
        best_values, best_ids = values.tolist(), ids.tolist()
    return [
        TokenLogprob(int(token), float(value), tuple(zip(ids_, values_, strict=True)))
        for token, value, ids_, values_ in zip(
            tokens.tolist(), chosen, best_ids, best_values, strict=True
        )
    ]
