"""Verification: which drafted tokens the target accepts, and the bonus token it adds.

Definitions (one step, one tree):
- **accepted**: the root-to-node path of tree nodes the target agrees with. The root (the last
  committed token) is always on it; its drafted descendants are accepted as the rules below say.
- **bonus**: the one token the target contributes after the accepted path, drawn from the
  target's (residual) distribution at the last accepted node. So every step commits
  ``len(accepted) - 1`` drafted tokens plus the bonus, at least one token per target forward.

Greedy: the longest path whose every token equals the target's argmax at its parent.
Sampling: recursive rejection sampling down the tree. At a node with target distribution p, the
children are tried in tree order; child i was proposed by q_i (a point mass for top-k drafts and
for chains grafted from the context; the draft distribution with the earlier draws removed and
renormalised for draws without replacement). It is accepted with probability
min(1, p(x)/q_i(x)); on rejection p becomes norm(max(p - q_i, 0)) and the next sibling is
tried. Each level is an exact rejection sampler for the current residual whatever its proposal,
provided child i was there before its own token was drawn (whether it exists may depend on its
earlier siblings, never on itself or later ones: see ``DraftSampling``), so the committed token
has exactly the target distribution. When every child is rejected, or the node is a leaf, the
bonus is drawn from p.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from selfspec.sampling import SamplingParams, greedy_tokens, sample_from, warp_probs
from selfspec.tree import DraftSampling, Tree


@dataclass
class Verdict:
    accepted: torch.Tensor  # [A] node indices root..last accepted, ascending
    bonus: int

    @property
    def num_drafted_accepted(self) -> int:
        return int(self.accepted.shape[0]) - 1


def verify_greedy(tree: Tree, ancestors: torch.Tensor, target_logits: torch.Tensor) -> Verdict:
    """Longest fully matching path; vectorised, one host sync.

    ancestors: # [T, T] bool; target_logits: # [T, vocab]
    """
    target_argmax = greedy_tokens(target_logits)  # [T]
    matches = tree.tokens == target_argmax[tree.parents.clamp(min=0)]  # [T]
    matches[0] = True
    path_ok = ~(ancestors & ~matches.unsqueeze(0)).any(-1)  # [T]
    # Deepest fully matching node; among equals the lowest index (the likeliest draft).
    reach = torch.where(path_ok, tree.depths, -1)
    best = int(reach.argmax())
    accepted = ancestors[best].nonzero().squeeze(1)  # [A], ascending = root first
    return Verdict(accepted=accepted, bonus=int(target_argmax[best]))


def verify_sampling(
    tree: Tree,
    target_logits: torch.Tensor,
    params: SamplingParams,
    generator: torch.Generator | None,
) -> Verdict:
    """Recursive rejection sampling down the tree. target_logits: # [T, vocab]"""
    target_probs = warp_probs(target_logits, params)  # [T, vocab]
    children = tree.children()
    tokens = tree.tokens.tolist()
    point_mass = (
        [True] * tree.size
        if tree.sampling is DraftSampling.TOP_K
        else (tree.point_mass.tolist() if tree.point_mass is not None else [False] * tree.size)
    )
    ranks = tree.draw_ranks.tolist()
    rows = tree.expanded_row.tolist()
    uniforms = torch.rand(tree.size, generator=generator, device=target_logits.device).tolist()
    node = 0
    path = [0]
    while True:
        residual = target_probs[node]  # [vocab]
        next_node = None
        for child in children[node]:
            token = tokens[child]
            if point_mass[child]:
                proposal_prob = 1.0
                proposal = None
            else:
                proposal = _without_replacement_proposal(tree, rows[node], ranks[child])
                proposal_prob = float(proposal[token])
            target_prob = float(residual[token])
            # One uniform per child: each child is tried at most once per step.
            if uniforms[child] * proposal_prob < target_prob:
                next_node = child
                break
            residual = _residual(residual, token, proposal)
        if next_node is None:
            bonus = int(sample_from(residual, generator))
            return Verdict(accepted=torch.tensor(path, device=tree.tokens.device), bonus=bonus)
        node = next_node
        path.append(node)


def _without_replacement_proposal(tree: Tree, row: int, rank: int) -> torch.Tensor:
    """The draft distribution the rank-th draw came from: earlier draws removed, renormalised."""
    proposal = tree.draft_probs[row].clone()  # [vocab]
    earlier = tree.draws[row, :rank]
    proposal[earlier[earlier >= 0]] = 0.0
    return proposal / proposal.sum()


def _residual(residual: torch.Tensor, token: int, proposal: torch.Tensor | None) -> torch.Tensor:
    """norm(max(p - q, 0)) after a rejected proposal. # [vocab]"""
    if proposal is None:  # point mass on `token`
        updated = residual.clone()
        updated[token] = 0.0
    else:
        updated = (residual - proposal).clamp(min=0.0)
    total = updated.sum()
    # total == 0 only when p <= q everywhere, i.e. p == q, where rejection has probability 0;
    # float rounding can still land here, and then p itself is the right distribution.
    return residual if total <= 0 else updated / total
