"""Draft trees: what one decoding step proposes, and the buffers that verify it in one forward.

Node 0 is the root: the last committed token, not yet run through the target. Every other
node is a drafted token; ``parents[i] < i`` always (parents come first), and siblings appear in
the order they were drawn, so walking children in index order is walking them in draw order.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from enum import Enum

import torch


class DraftSampling(str, Enum):
    """How a node's children are chosen from the draft distribution."""

    TOP_K = "top_k"
    """The k most likely tokens, deterministically (EAGLE-2). Verified as point-mass proposals."""
    WITHOUT_REPLACEMENT = "without_replacement"
    """k tokens sampled from the draft without replacement (Gumbel top-k), as in Recursive
    Speculative Decoding: accepted with probability sum(min(p, q)) rather than p(token), so a
    drafter close to the target accepts deep at high temperature, where no fixed token does.
    A dynamic tree then scores a child by its rank's value (the rank-th largest draft
    probability), never by the token it drew, so which nodes are kept never depends on their
    own draws and the draws stay samples of their proposals. Where a node's survival does
    depend on values that follow from its draw (the best count of an adaptive sizer's
    ``keep``), the tree falls back to the point-mass rule: still exact, accepted less often; an
    adaptive tree of sampled draws is therefore sized by a stopping rule
    (``TreeSizer.keep_as_drawn``, ``sizing.joint_keep(as_drawn=True)`` for a batch). The
    default when sampling: at T=1 it accepts more than the top k with the same heads and
    tree (``benchmarks/tau_heldout.py``)."""


@dataclass(frozen=True)
class StaticTree:
    """A fixed tree given as paths of sibling ranks (Medusa style).

    ``(0, 1)`` is the second-ranked child of the top-ranked child of the root. Every prefix of
    a path is a node too; listing it is optional.
    """

    paths: tuple[tuple[int, ...], ...]

    def __post_init__(self) -> None:
        if not self.paths:
            raise ValueError("a static tree needs at least one path")
        for path in self.paths:
            if not path or any((not isinstance(r, int)) or r < 0 for r in path):
                raise ValueError(
                    f"static tree path {path!r} must be a non-empty tuple of ranks >= 0"
                )
        object.__setattr__(self, "paths", tuple(tuple(p) for p in self.paths))

    @property
    def depth(self) -> int:
        return max(len(p) for p in self.paths)

    def nodes(self) -> list[tuple[int, ...]]:
        """Every node (path prefix), parents before children, siblings by rank."""
        prefixes = {p[:d] for p in self.paths for d in range(1, len(p) + 1)}
        return sorted(prefixes, key=lambda p: (len(p), p))

    @classmethod
    def chain(cls, depth: int) -> StaticTree:
        """A single path of top-1 drafts: classic (non-tree) speculative decoding."""
        return cls(paths=(tuple([0] * depth),))

    @classmethod
    def full(cls, widths: tuple[int, ...]) -> StaticTree:
        """Every combination of ranks below the given width at each depth."""
        return cls(paths=tuple(itertools.product(*(range(w) for w in widths))))


@dataclass(frozen=True)
class DynamicTree:
    """A tree grown by draft confidence (EAGLE-2 style).

    At each depth the ``top_k`` most confident frontier nodes are expanded by their ``top_k``
    children; after ``depth`` rounds the ``budget`` drafted nodes with the highest cumulative
    draft log-probability are kept (a kept node's parent always scores at least as high).
    """

    top_k: int = 4
    depth: int = 5
    budget: int = 24
    adaptive: bool = False
    """True: ``depth`` and ``budget`` are upper bounds; each step drafts deeper and keeps as many
    nodes as maximise expected tokens per second on the measured cost curve (``sizing.py``)."""

    def __post_init__(self) -> None:
        for name in ("top_k", "depth", "budget"):
            if getattr(self, name) < 1:
                raise ValueError(f"dynamic tree {name} must be >= 1, got {getattr(self, name)}")


TreeSpec = StaticTree | DynamicTree

ADAPTIVE_TREE = DynamicTree(top_k=8, depth=6, budget=48, adaptive=True)
"""The adaptive tree's bounds: wide and deep enough that the cost curve, not the bounds, decides."""

# A compact default for Medusa-style static trees (depth 4, 31 drafted nodes): wide near the
# root, where acceptance is likeliest, narrow below.
DEFAULT_STATIC_TREE = StaticTree(
    paths=(
        (0, 0, 0, 0),
        (0, 0, 0, 1),
        (0, 0, 1, 0),
        (0, 1, 0, 0),
        (1, 0, 0, 0),
        (0, 0, 2),
        (0, 1, 1),
        (0, 2, 0),
        (1, 0, 1),
        (1, 1, 0),
        (2, 0, 0),
        (0, 3),
        (1, 2),
        (2, 1),
        (3, 0),
        (4,),
        (5,),
    )
)


@dataclass
class Tree:
    """One step's draft. T nodes including the root; E of them were expanded (have children)."""

    tokens: torch.Tensor  # [T] token ids; tokens[0] is the root
    parents: torch.Tensor  # [T] parent index, -1 for the root
    depths: torch.Tensor  # [T] 0 for the root
    draw_ranks: torch.Tensor  # [T] position of the node in its parent's draw order (root: 0)
    expanded_row: torch.Tensor  # [T] row of draft_probs / draws for the node's children, or -1
    draft_probs: torch.Tensor  # [E, vocab] distribution the children were drawn from
    draws: torch.Tensor  # [E, k] tokens in draw order (padded with -1)
    sampling: DraftSampling
    scores: torch.Tensor | None = None
    """# [T] cumulative draft log-probability of each node (root 0); None if not drafted."""
    point_mass: torch.Tensor | None = None
    """# [T] bool: in a sampled tree, the nodes that are not draws (chains grafted from the
    context), verified as point-mass proposals after their parent's drawn children; None:
    none."""

    @property
    def size(self) -> int:
        return int(self.tokens.shape[0])

    def ancestors(self) -> torch.Tensor:
        """ancestors[i, j] is True when j is i or an ancestor of i. # [T, T] bool"""
        size = self.size
        anc = torch.eye(size, dtype=torch.bool, device=self.tokens.device)
        parent = self.parents.clamp(min=0)
        has_parent = (self.parents >= 0).unsqueeze(1)  # [T, 1]
        # Each round pulls in one more generation of ancestors; depth rounds reach the root.
        for _ in range(int(self.depths.max())):
            anc = anc | (anc[parent] & has_parent)
        return anc

    def children(self) -> list[list[int]]:
        """Children of every node, in draw order (index order)."""
        kids: list[list[int]] = [[] for _ in range(self.size)]
        for child, parent in enumerate(self.parents.tolist()):
            if parent >= 0:
                kids[parent].append(child)
        return kids


def prune(tree: Tree, count: int, as_drawn: bool = False) -> Tree:
    """The root and the ``count`` best-scored drafted nodes of ``tree`` (ties: creation order),
    re-indexed; ``tree`` itself when it has no more. A kept node's parent is always kept (a
    child never outscores its parent, and parents come first). ``as_drawn``: ``count`` was
    chosen so that no node's survival depends on its own draw (``sizing.joint_keep``'s stopping
    rule), and a sampled tree stays sampled; otherwise ``count`` may follow from every score,
    so a sampled tree that loses nodes is verified with the point-mass rule (see
    ``DraftSampling``) and its draft distribution is dropped."""
    if tree.scores is None:
        raise ValueError("only a drafted tree (with scores) can be pruned")
    if count < 0:
        raise ValueError(f"count must be >= 0, got {count}")
    if count >= tree.size - 1:
        return tree
    scores = tree.scores.tolist()
    ranked = sorted(range(1, tree.size), key=lambda node: -scores[node])  # stable: ties by index
    keep = [0, *sorted(ranked[:count])]
    new_index = {old: new for new, old in enumerate(keep)}
    parents = [new_index[parent] if parent >= 0 else -1 for parent in tree.parents[keep].tolist()]
    index = torch.tensor(keep, dtype=torch.long, device=tree.tokens.device)
    sampled = as_drawn and tree.sampling is DraftSampling.WITHOUT_REPLACEMENT
    return Tree(
        tokens=tree.tokens[index],
        parents=torch.tensor(parents, dtype=torch.long, device=tree.tokens.device),
        depths=tree.depths[index],
        draw_ranks=tree.draw_ranks[index],
        expanded_row=tree.expanded_row[index],
        draft_probs=tree.draft_probs if sampled else tree.draft_probs[:0],
        draws=tree.draws,
        sampling=tree.sampling if sampled else DraftSampling.TOP_K,
        scores=tree.scores[index],
        point_mass=tree.point_mass[index] if sampled and tree.point_mass is not None else None,
    )


@dataclass
class TreeBuffers:
    """What one verification forward needs, built from a tree and the committed length."""

    ancestors: torch.Tensor  # [T, T] bool
    position_ids: torch.Tensor  # [1, T]
    attention_mask: torch.Tensor  # [1, 1, T, cache + T] float: 0 allowed, dtype-min masked


def tree_buffers(tree: Tree, cache_len: int, dtype: torch.dtype) -> TreeBuffers:
    """Tree attention mask over cache + tree, and per-node positions (cache_len + depth)."""
    ancestors = tree.ancestors()
    size = tree.size
    mask = torch.zeros(1, 1, size, cache_len + size, dtype=dtype, device=tree.tokens.device)
    blocked = torch.finfo(dtype).min
    mask[0, 0, :, cache_len:] = torch.where(ancestors, 0.0, blocked).to(dtype)
    position_ids = (tree.depths + cache_len).unsqueeze(0)
    return TreeBuffers(ancestors=ancestors, position_ids=position_ids, attention_mask=mask)


def parse_tree_spec(text: str) -> TreeSpec | None:
    """Parse a tree description as the CLI and server take it.

    ``auto`` (None: the heads' default), ``static`` (DEFAULT_STATIC_TREE), ``chain:D``,
    ``dynamic`` or ``dynamic:TOP_K,DEPTH,BUDGET``, ``adaptive`` or ``adaptive:TOP_K,DEPTH,BUDGET``
    (size chosen per step from the cost curve, up to BUDGET), or a path to a JSON list of rank
    paths.
    """
    import json
    from pathlib import Path

    kind, _, args = text.strip().partition(":")
    try:
        if kind == "auto" and not args:
            return None
        if kind == "static" and not args:
            return DEFAULT_STATIC_TREE
        if kind == "chain":
            return StaticTree.chain(int(args))
        if kind in ("dynamic", "adaptive"):
            adaptive = kind == "adaptive"
            if not args:
                return ADAPTIVE_TREE if adaptive else DynamicTree()
            top_k, depth, budget = (int(v) for v in args.split(","))
            return DynamicTree(top_k=top_k, depth=depth, budget=budget, adaptive=adaptive)
    except ValueError as error:
        raise ValueError(f"invalid tree {text!r}: {error}") from error
    path = Path(text)
    if path.suffix == ".json" and path.is_file():
        try:
            paths = json.loads(path.read_text())
            return StaticTree(paths=tuple(tuple(int(r) for r in p) for p in paths))
        except (json.JSONDecodeError, TypeError, ValueError) as error:
            raise ValueError(
                f"tree file {path} must hold a JSON list of rank paths: {error}"
            ) from error
    raise ValueError(
        f"invalid tree {text!r}: expected auto, static, chain:D, dynamic[:TOP_K,DEPTH,BUDGET], "
        "adaptive[:TOP_K,DEPTH,BUDGET] or a .json file of rank paths"
    )
