"""The losses train what the engine later does: positions, shifts, and simulated draft steps."""

from __future__ import annotations

import torch
from torch import nn

from selfspec.heads import EagleCache, EagleHead, HeadsConfig
from selfspec.train.losses import eagle_unroll, response_positions


def test_unrolled_steps_equal_incremental_chain_drafting() -> None:
    torch.manual_seed(0)
    config = HeadsConfig(kind="eagle", hidden_size=32, vocab_size=50, num_attention_heads=4)
    head = EagleHead(config)
    with torch.no_grad():
        for parameter in head.parameters():  # leave the identity init: make every path count
            parameter.normal_(0, 0.2)
    embed = nn.Embedding(50, 32)
    ids = torch.randint(0, 50, (2, 12))  # [B, L]
    features = torch.randn(2, 11, 32)  # [B, L-1, H]
    with torch.no_grad():
        steps = eagle_unroll(head, embed, ids, features, depth=3)  # each [B, L-2, H]
        for j in (0, 4, 7):
            # As the drafter does: commit (f_i, x_{i+1}) for i <= j, then a chain of drafts.
            cache = EagleCache()
            positions = torch.arange(1, j + 2).expand(2, -1)
            out = head(embed(ids[:, 1 : j + 2]), features[:, : j + 1], positions, cache=cache)
            node = out[:, -1:]  # [B, 1, H] the root's predicted feature
            torch.testing.assert_close(node[:, 0], steps[0][:, j])
            for depth in (2, 3):
                token = ids[:, j + depth : j + depth + 1]
                node = head(embed(token), node, torch.full((2, 1), j + depth), cache=cache)
                torch.testing.assert_close(node[:, 0], steps[depth - 1][:, j])


def test_response_positions_cover_features_whose_next_token_is_a_response_token() -> None:
    lengths = torch.tensor([6, 4])  # row 1 is padded from 4 tokens to 6
    prompt_len = torch.tensor([3, 2])
    mask = response_positions(lengths, prompt_len, width=5)  # features f_0 .. f_4
    # Row 0: tokens x_3..x_5 are the response, predicted from f_2..f_4.
    assert mask.tolist() == [
        [False, False, True, True, True],
        [False, True, True, False, False],
    ]
