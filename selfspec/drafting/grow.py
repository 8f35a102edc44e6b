"""Grow a draft tree, static or dynamic, from any head that can score a frontier of nodes.

The head is reached through ``expand(tree, frontier) -> draft logits # [F, N]`` for the
children of each frontier node, so Medusa (one distribution per depth) and EAGLE (one forward per
depth) share the same growth, scoring and selection. N is the draft vocabulary (the whole
vocabulary unless the heads carry a smaller one); ``projection`` maps draws back to token ids.
A ``growth`` yields each frontier and is sent its logits, so several requests' trees can grow in
lock step with one head call per depth for all of them (``EagleDrafter.draft_many``).

A dynamic tree's size is either fixed (its ``budget``) or chosen per step by a ``TreeSizer``
from the measured cost of verification (see ``sizing.py``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass, field

import torch

from selfspec.drafting.context import ContextChain
from selfspec.drafting.projection import DraftProjection
from selfspec.drafting.sizing import TreeSizer
from selfspec.sampling import SamplingParams, warp_probs
from selfspec.tree import DraftSampling, DynamicTree, StaticTree, Tree, TreeSpec


@dataclass(frozen=True)
class DraftPlan:
    """How one step drafts: the tree shape, how children are drawn, and the sampling warp."""

    tree: TreeSpec
    sampling: DraftSampling = DraftSampling.TOP_K
    params: SamplingParams = SamplingParams()
    sizer: TreeSizer | None = None
    """Dynamic trees only: chooses depth and size per step; None keeps ``tree.budget`` nodes."""
    defer_keep: bool = False
    """With a sizer: it chooses the depth, but the tree keeps its best ``tree.budget`` nodes and
    the caller chooses how many to verify (``sizing.joint_keep`` for a batch, then
    ``tree.prune``)."""
    context: tuple[ContextChain, ...] = ()
    """Chains from the request's context and the draft corpus (``selfspec.drafting.context``),
    grafted into the grown tree before its nodes are chosen, so they compete with the heads'
    nodes by score."""


@dataclass
class GrowingTree:
    """Nodes appended in creation order: parents first, siblings in draw order."""

    tokens: list[int]
    parents: list[int] = field(default_factory=lambda: [-1])
    depths: list[int] = field(default_factory=lambda: [0])
    ranks: list[int] = field(default_factory=lambda: [0])
    scores: list[float] = field(default_factory=lambda: [0.0])
    expanded_row: list[int] = field(default_factory=lambda: [-1])
    point_mass: list[bool] = field(default_factory=lambda: [False])
    """Per node: not a draw of the heads (a grafted context chain's node)."""
    prob_rows: list[torch.Tensor] = field(default_factory=list)  # each [N]
    draw_rows: list[torch.Tensor] = field(default_factory=list)  # each [k] token ids

    @property
    def size(self) -> int:
        return len(self.tokens)

    def add(
        self, parent: int, token: int, rank: int, logprob: float, point_mass: bool = False
    ) -> int:
        self.tokens.append(token)
        self.point_mass.append(point_mass)
        self.parents.append(parent)
        self.depths.append(self.depths[parent] + 1)
        self.ranks.append(rank)
        self.scores.append(self.scores[parent] + logprob)
        self.expanded_row.append(-1)
        return self.size - 1


ExpandFn = Callable[[GrowingTree, list[int]], torch.Tensor]


def draw_children(
    logits: torch.Tensor,  # [F, N]
    k: int,
    plan: DraftPlan,
    generator: torch.Generator | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """k children per row: indices into the N columns # [F, k] (-1 where none could be drawn),
    their scores' log-values # [F, k], and the distribution drawn from # [F, N].

    A top-k child's value is its draft log-prob. A sampled child's value is its rank's (the
    rank-th largest log-prob of the distribution drawn from), not its token's: the tree's
    choices then never depend on what a node drew (see ``DraftSampling``)."""
    k = min(k, logits.shape[-1])
    if not _samples(plan):
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        values, tokens = torch.topk(logprobs, k, dim=-1)
        return tokens, values, logprobs.exp()
    probs = warp_probs(logits, plan.params)  # [F, vocab]
    uniform = torch.rand(probs.shape, generator=generator, device=probs.device)
    gumbel = -torch.log(-torch.log(uniform.clamp(1e-20, 1.0 - 1e-7)))
    perturbed, tokens = torch.topk(probs.log() + gumbel, k, dim=-1)  # Gumbel top-k
    tokens = torch.where(torch.isfinite(perturbed), tokens, -1)  # ran out of support
    rank_values = torch.topk(probs, k, dim=-1).values.log()  # [F, k] non-increasing
    return tokens, rank_values, probs


def _record_children(
    tree: GrowingTree,
    frontier: list[int],
    logits: torch.Tensor,  # [F, N] the head's scores for the frontier's children
    k: int,
    plan: DraftPlan,
    generator: torch.Generator | None,
    projection: DraftProjection | None,
) -> tuple[list[list[int]], list[list[float]]]:
    """Draw k children for each frontier node; record the draft rows. Returns tokens, logprobs."""
    indices, logprobs, probs = draw_children(logits, k, plan, generator)
    tokens = indices if projection is None else projection.token_ids(indices)  # [F, k]
    for i, node in enumerate(frontier):
        tree.expanded_row[node] = len(tree.prob_rows)
        tree.prob_rows.append(probs[i])
        tree.draw_rows.append(tokens[i])
    return tokens.tolist(), logprobs.tolist()


Growth = Generator[tuple[GrowingTree, list[int]], torch.Tensor, Tree]
"""A tree being grown: yields (tree so far, frontier) whenever it needs the head's draft logits
for the frontier's children, is sent them # [F, N], and returns the finished Tree."""

Clock = Callable[[], float]
"""Seconds of drafting spent on this tree so far (the adaptive sizer prices depth with it)."""


def growth(
    root_token: int,
    plan: DraftPlan,
    generator: torch.Generator | None,
    projection: DraftProjection | None = None,
    clock: Clock | None = None,
) -> Growth:
    """The tree of ``plan`` grown from ``root_token``, one frontier at a time: a caller may drive
    several requests' growths in lock step and score all their frontiers in one head call
    (``EagleDrafter.draft_many``). ``clock``: None times this growth from now."""
    if clock is None:
        clock = _stopwatch()
    if isinstance(plan.tree, StaticTree):
        return _grow_static(root_token, plan.tree, plan, generator, projection)
    return _grow_dynamic(root_token, plan.tree, plan, generator, projection, clock)


def grow_tree(
    root_token: int,
    expand: ExpandFn,
    plan: DraftPlan,
    generator: torch.Generator | None,
    projection: DraftProjection | None = None,
) -> Tree:
    """One request's tree, its frontiers scored by ``expand``."""
    return drive(growth(root_token, plan, generator, projection), expand)


def drive(grown: Growth, expand: ExpandFn) -> Tree:
    """Run a growth to its tree, answering each frontier with ``expand``."""
    try:
        tree, frontier = next(grown)
        while True:
            tree, frontier = grown.send(expand(tree, frontier))
    except StopIteration as finished:
        return finished.value


def _stopwatch() -> Clock:
    started = time.perf_counter()
    return lambda: time.perf_counter() - started


def _grow_dynamic(
    root_token: int,
    spec: DynamicTree,
    plan: DraftPlan,
    generator: torch.Generator | None,
    projection: DraftProjection | None,
    clock: Clock,
) -> Growth:
    tree = GrowingTree(tokens=[root_token])
    frontier = [0]
    if spec.adaptive and plan.sizer is None:
        raise ValueError("an adaptive tree needs a TreeSizer (a generator with a cost curve)")
    sizer = plan.sizer if spec.adaptive else None
    for depth in range(1, spec.depth + 1):
        logits = yield tree, frontier
        tokens, logprobs = _record_children(
            tree, frontier, logits, spec.top_k, plan, generator, projection
        )
        new_nodes = [
            tree.add(parent, token, rank, logprob)
            for parent, row_tokens, row_logprobs in zip(frontier, tokens, logprobs, strict=True)
            for rank, (token, logprob) in enumerate(zip(row_tokens, row_logprobs, strict=True))
            if token >= 0
        ]
        if depth == spec.depth or not new_nodes:
            break
        # Expand the most confident new nodes next (stable: ties keep creation order).
        frontier = sorted(new_nodes, key=lambda n: -tree.scores[n])[: spec.top_k]
        frontier.sort()
        if sizer is not None and not sizer.grow_deeper(
            tree.scores[1:], [tree.scores[n] for n in frontier], clock(), depth, spec
        ):
            break
    graft_context(tree, plan.context, spec.depth, _samples(plan))
    # Keep the best drafted nodes. A child never outscores its parent (log-probs <= 0) and ties
    # keep creation order, so every kept node's parent is kept too. With a fixed budget, or a
    # sizer's stopping rule for sampled draws, whether a node is kept follows from the scores
    # ranked at or above it, none of which depend on its own draw; ``keep``'s best count
    # follows from every score.
    ranked = sorted(range(1, tree.size), key=lambda n: -tree.scores[n])
    budget = spec.budget
    chosen_by_value = False
    if sizer is not None and not plan.defer_keep:
        scores = [tree.scores[n] for n in ranked[:budget]]
        if _samples(plan):
            budget = sizer.keep_as_drawn(scores, spec.budget)
        else:
            budget, chosen_by_value = sizer.keep(scores, clock()), True
    keep = [0, *sorted(ranked[:budget])]
    return _finish(tree, keep, plan, projection, chosen_by_value)


def _grow_static(
    root_token: int,
    spec: StaticTree,
    plan: DraftPlan,
    generator: torch.Generator | None,
    projection: DraftProjection | None,
) -> Growth:
    tree = GrowingTree(tokens=[root_token])
    node_of: dict[tuple[int, ...], int] = {(): 0}
    prefixes = spec.nodes()
    for depth in range(1, spec.depth + 1):
        layer = [p for p in prefixes if len(p) == depth and p[:-1] in node_of]
        parents = sorted({p[:-1] for p in layer}, key=lambda p: node_of[p])
        if not parents:
            break
        frontier = [node_of[p] for p in parents]
        width = 1 + max(p[-1] for p in layer)
        logits = yield tree, frontier
        tokens, logprobs = _record_children(
            tree, frontier, logits, width, plan, generator, projection
        )
        row_of = {parent: i for i, parent in enumerate(parents)}
        for prefix in layer:  # sorted by (parent prefix, rank): siblings in draw order
            row, rank = row_of[prefix[:-1]], prefix[-1]
            if rank < len(tokens[row]) and tokens[row][rank] >= 0:  # ranks beyond vocab: no node
                node_of[prefix] = tree.add(
                    node_of[prefix[:-1]], tokens[row][rank], rank, logprobs[row][rank]
                )
    graft_context(tree, plan.context, spec.depth, _samples(plan))
    return _finish(tree, list(range(tree.size)), plan, projection)


def context_tree(root_token: int, plan: DraftPlan, device: torch.device) -> Tree:
    """The root and ``plan``'s context chains alone, for a step whose heads do not draft (the
    speculation gate's call): up to the tree's depth (and a dynamic tree's budget), and with an
    adaptive plan's sizer as many of their tokens as pay for their verification (chains cost
    no drafting time), unless the plan leaves that to the caller (``defer_keep``: a batch's
    trees sized together)."""
    tree = GrowingTree(tokens=[root_token])
    graft_context(tree, plan.context, plan.tree.depth)
    ranked = sorted(range(1, tree.size), key=lambda n: -tree.scores[n])  # parents first
    size = min(len(ranked), getattr(plan.tree, "budget", len(ranked)))
    if plan.sizer is not None and getattr(plan.tree, "adaptive", False) and not plan.defer_keep:
        size = plan.sizer.keep([tree.scores[n] for n in ranked[:size]], 0.0)
    keep = [0, *sorted(ranked[:size])]
    return _finish(tree, keep, plan, None, device=device)


def _samples(plan: DraftPlan) -> bool:
    """Whether ``plan`` draws children by sampling (else top-k)."""
    return plan.sampling is DraftSampling.WITHOUT_REPLACEMENT and not plan.params.greedy


def graft_context(
    tree: GrowingTree, chains: Sequence[ContextChain], depth: int, sampled: bool = False
) -> None:
    """Add each chain's first ``depth`` tokens (the tree's depth bound) below the root,
    following nodes already there with the same tokens and appending the rest after their
    siblings, as point-mass proposals; a node on a chain scores the best of its estimates.
    Every kind of score falls along a path, so a child still never outscores its parent.

    ``sampled``: the heads' nodes are draws, and a chain follows none of them: a draw that
    happened to equal a chain's token would then be scored (and kept) for what it drew, and it
    would no longer be a sample of its proposal. The chains stay apart, tried after the drawn
    siblings, and never depend on a draw."""
    for chain in chains:
        _graft_chain(tree, chain, depth, sampled)


def _graft_chain(tree: GrowingTree, chain: ContextChain, depth: int, sampled: bool) -> None:
    child_of: dict[tuple[int, int], int] = {}
    children = [0] * tree.size
    for node in range(1, tree.size):
        if tree.point_mass[node] or not sampled:
            child_of.setdefault((tree.parents[node], tree.tokens[node]), node)
        children[tree.parents[node]] += 1
    node = 0
    for token, score in zip(chain.tokens[:depth], chain.scores[:depth], strict=True):
        child = child_of.get((node, token))
        if child is None:
            child = tree.add(node, token, children[node], 0.0, point_mass=True)
            children[node] += 1
            children.append(0)
            tree.scores[child] = score
        else:
            tree.scores[child] = max(tree.scores[child], score)
        node = child


def _finish(
    tree: GrowingTree,
    keep: list[int],
    plan: DraftPlan,
    projection: DraftProjection | None,
    chosen_by_value: bool = False,
    device: torch.device | None = None,
) -> Tree:
    """Freeze the kept nodes (ascending creation order) into tensors, re-indexing parents.

    ``chosen_by_value``: how many nodes to keep was chosen from every node's score, so a
    sampled child may have been kept *because of what it drew* and is no longer a sample of its
    without-replacement proposal; such trees are verified with the point-mass rule, which is
    exact for any candidates chosen without the target's randomness.
    """
    new_index = {old: new for new, old in enumerate(keep)}
    if device is None:
        device = tree.prob_rows[0].device if tree.prob_rows else torch.device("cpu")
    vocab = (
        projection.vocab_size
        if projection is not None
        else (tree.prob_rows[0].shape[-1] if tree.prob_rows else 0)
    )
    width = max((int(r.shape[0]) for r in tree.draw_rows), default=1)
    draws = torch.full((max(len(tree.draw_rows), 1), width), -1, dtype=torch.long, device=device)
    for i, row in enumerate(tree.draw_rows):
        draws[i, : row.shape[0]] = row
    sampled = _samples(plan) and not chosen_by_value and bool(tree.prob_rows)
    # Point-mass (top-k) proposals never read the draft distribution: don't keep it.
    if sampled:
        probs = torch.stack(tree.prob_rows)  # [E, N]
        probs = probs if projection is None else projection.to_full(probs)  # [E, vocab]
    else:
        probs = torch.zeros(0, vocab, device=device)

    def column(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=device)

    return Tree(
        tokens=column([tree.tokens[n] for n in keep]),
        parents=column([new_index[tree.parents[n]] if n else -1 for n in keep]),
        depths=column([tree.depths[n] for n in keep]),
        draw_ranks=column([tree.ranks[n] for n in keep]),
        expanded_row=column([tree.expanded_row[n] for n in keep]),
        draft_probs=probs,
        draws=draws,
        sampling=DraftSampling.WITHOUT_REPLACEMENT if sampled else DraftSampling.TOP_K,
        scores=torch.tensor([tree.scores[n] for n in keep], device=device),
        point_mass=(
            torch.tensor([tree.point_mass[n] for n in keep], dtype=torch.bool, device=device)
            if sampled
            else None
        ),
    )
