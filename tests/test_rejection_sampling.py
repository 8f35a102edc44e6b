"""Recursive rejection sampling is lossless: committed tokens have the warped target distribution.

Setup: vocabulary of 6; the target's logits at a tree node are a fixed table indexed by
(depth, token), so every node's target distribution depends on its path; the draft's logits come
from a different table. Trees are grown by the real `grow_tree`, verified by the real
`verify_sampling`, and the committed tokens are compared with the target's distributions:

- the first committed token ~ warp(target at the root);
- given the first committed token x was an accepted draft, the second ~ warp(target at x).
  (Each level of the recursion is an exact sampler for its node's distribution whatever happened
  above it, so conditioning on acceptance above is allowed.)

Statistics: Pearson chi-square goodness of fit, cells with expected count < 5 pooled. The check
passes when the p-value exceeds 1e-3: under a correct verifier it fails with probability 1e-3 per
check (seeds are fixed, so the outcome is deterministic; the seeds were not tuned). Power: at N
trials the statistic's mean under an alternative is dof + N * sum(delta^2 / p); with N = 1000 and
dof = 5 the 1e-3 critical value 20.5 is crossed once sum(delta^2 / p) > ~0.016, i.e. a shift of
~3-5 points of probability on a likely token. The negative controls below show that the same
check, at the same N, rejects plausible wrong verifiers: accept every draft; forget the residual
after a rejection (top-k and sampled drafts); skip the renormalisation of later
without-replacement draws. (Verifying sampled drafts with the point-mass rule of top-k drafts is
NOT such a control: that rule is exact for any candidates chosen independently of the target's
randomness, only accepted less often.)
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from selfspec.cost_curve import CostCurve
from selfspec.drafting import grow
from selfspec.drafting.context import ContextChain
from selfspec.drafting.grow import DraftPlan, GrowingTree, grow_tree
from selfspec.drafting.sizing import TreeSizer
from selfspec.sampling import SamplingParams, sample_from, warp_probs
from selfspec.tree import DraftSampling, DynamicTree, StaticTree, Tree, TreeSpec
from selfspec.verify import Verdict, verify_sampling

VOCAB = 6
MAX_DEPTH = 4
ROOT = 0
P_VALUE_FLOOR = 1e-3
TRIALS = 1000

_tables = torch.Generator().manual_seed(20240601)
TARGET_LOGITS = torch.randn(MAX_DEPTH, VOCAB, VOCAB, generator=_tables) * 1.5  # [depth, token, V]
DRAFT_LOGITS = torch.randn(MAX_DEPTH, VOCAB, VOCAB, generator=_tables) * 1.5  # [depth, token, V]
# An overconfident draft: its first draw often holds most of the mass, so the renormalised
# proposals of later without-replacement draws differ a lot from the raw draft distribution.
PEAKY_DRAFT_LOGITS = DRAFT_LOGITS * 2.5

Verifier = Callable[[Tree, torch.Tensor, SamplingParams, torch.Generator], Verdict]

T1 = SamplingParams(temperature=1.0)
TOPK = SamplingParams(temperature=0.7, top_k=3)
TOPP = SamplingParams(temperature=1.3, top_p=0.8)
WARPED = SamplingParams(temperature=0.8, top_k=4, top_p=0.9)
SAMPLED = DraftSampling.WITHOUT_REPLACEMENT
TOPK_DRAWS = DraftSampling.TOP_K
CHAIN = StaticTree.chain(3)
BRANCHING = StaticTree.full((3, 2))


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Small tensors run much faster on one thread than on two contended ones."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# -- harness -------------------------------------------------------------------------------------


def _draft_expand(draft_table: torch.Tensor) -> Callable[[GrowingTree, list[int]], torch.Tensor]:
    def expand(tree: GrowingTree, frontier: list[int]) -> torch.Tensor:
        depths = torch.tensor([tree.depths[n] for n in frontier])
        tokens = torch.tensor([tree.tokens[n] for n in frontier])
        return draft_table[depths, tokens]  # [F, vocab]

    return expand


def _target_logits(tree: Tree, table: torch.Tensor = TARGET_LOGITS) -> torch.Tensor:
    return table[tree.depths, tree.tokens]  # [T, vocab]


def _run(
    spec: TreeSpec,
    sampling: DraftSampling,
    params: SamplingParams,
    trials: int = TRIALS,
    seed: int = 0,
    verifier: Verifier = verify_sampling,
    draft_table: torch.Tensor = DRAFT_LOGITS,
    target_table: torch.Tensor = TARGET_LOGITS,
    context: tuple[ContextChain, ...] = (),
) -> tuple[torch.Tensor, torch.Tensor, list[Verdict], list[Tree]]:
    """first # [V] counts of the first committed token; pairs # [V, V] counts of (first, second)
    over trials whose first token was an accepted draft."""
    generator = torch.Generator().manual_seed(seed)
    plan = DraftPlan(tree=spec, sampling=sampling, params=params, context=context)
    expand = _draft_expand(draft_table)
    first = torch.zeros(VOCAB, dtype=torch.long)
    pairs = torch.zeros(VOCAB, VOCAB, dtype=torch.long)
    verdicts, trees = [], []
    fixed = None
    if sampling is DraftSampling.TOP_K:  # deterministic drafts: the tree never changes
        fixed = grow_tree(ROOT, expand, plan, generator)
    for _ in range(trials):
        tree = fixed if fixed is not None else grow_tree(ROOT, expand, plan, generator)
        verdict = verifier(tree, _target_logits(tree, target_table), params, generator)
        committed = [*tree.tokens[verdict.accepted[1:]].tolist(), verdict.bonus]
        first[committed[0]] += 1
        if len(committed) > 1:
            pairs[committed[0], committed[1]] += 1
        verdicts.append(verdict)
        trees.append(tree)
    return first, pairs, verdicts, trees


def _pooled_chi_square(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
    """Pearson statistic and degrees of freedom; cells expecting < 5 are pooled."""
    total = int(counts.sum())
    expected = probs.double() * total
    observed = counts.double()
    big = expected >= 5
    bins_obs = [*observed[big].tolist()]
    bins_exp = [*expected[big].tolist()]
    small_obs, small_exp = float(observed[~big].sum()), float(expected[~big].sum())
    if small_exp > 0 or small_obs > 0:
        if small_exp >= 5 or not bins_exp:
            bins_obs.append(small_obs)
            bins_exp.append(small_exp)
        else:  # fold the too-small pool into the smallest regular bin
            smallest = min(range(len(bins_exp)), key=bins_exp.__getitem__)
            bins_obs[smallest] += small_obs
            bins_exp[smallest] += small_exp
    if any(e == 0 and o > 0 for o, e in zip(bins_obs, bins_exp, strict=True)):
        return float("inf"), max(len(bins_exp) - 1, 1)
    statistic = sum((o - e) ** 2 / e for o, e in zip(bins_obs, bins_exp, strict=True) if e > 0)
    return statistic, len(bins_exp) - 1


def _p_value(statistic: float, dof: int) -> float:
    if dof <= 0:
        return 1.0
    if statistic == float("inf"):
        return 0.0
    return float(
        torch.special.gammaincc(
            torch.tensor(dof / 2, dtype=torch.float64), torch.tensor(statistic / 2)
        )
    )


def _root_probs(params: SamplingParams) -> torch.Tensor:
    return warp_probs(TARGET_LOGITS[0, ROOT], params)  # [V]


def _child_probs(params: SamplingParams) -> torch.Tensor:
    return warp_probs(TARGET_LOGITS[1], params)  # [V (first token), V]


def _fit(first: torch.Tensor, pairs: torch.Tensor, params: SamplingParams) -> tuple[float, float]:
    """p-values of (first token ~ root target) and (second | first ~ child target, pooled)."""
    root = _root_probs(params)
    if (first[root == 0] > 0).any():
        return 0.0, 0.0
    first_p = _p_value(*_pooled_chi_square(first, root))
    child = _child_probs(params)
    statistic, dof = 0.0, 0
    for token in range(VOCAB):
        row = pairs[token]
        if (row[child[token] == 0] > 0).any():
            return first_p, 0.0
        if row.sum() >= 20:  # too few trials for the chi-square approximation otherwise
            row_stat, row_dof = _pooled_chi_square(row, child[token])
            statistic, dof = statistic + row_stat, dof + row_dof
    assert dof > 0, "no first token was accepted often enough to test the second"
    return first_p, _p_value(statistic, dof)


# -- the real verifier ---------------------------------------------------------------------------

CASES = [
    pytest.param(CHAIN, DraftSampling.TOP_K, T1, DRAFT_LOGITS, id="chain-topk-t1"),
    pytest.param(BRANCHING, DraftSampling.TOP_K, T1, DRAFT_LOGITS, id="tree-topk-t1"),
    pytest.param(BRANCHING, DraftSampling.TOP_K, TOPK, DRAFT_LOGITS, id="tree-topk-warp_top_k"),
    pytest.param(BRANCHING, DraftSampling.TOP_K, TOPP, DRAFT_LOGITS, id="tree-topk-warp_top_p"),
    pytest.param(
        DynamicTree(top_k=3, depth=3, budget=6),
        DraftSampling.TOP_K,
        T1,
        DRAFT_LOGITS,
        id="dyn-topk",
    ),
    pytest.param(CHAIN, DraftSampling.WITHOUT_REPLACEMENT, T1, DRAFT_LOGITS, id="chain-swor-t1"),
    pytest.param(BRANCHING, DraftSampling.WITHOUT_REPLACEMENT, T1, DRAFT_LOGITS, id="tree-swor-t1"),
    pytest.param(
        BRANCHING, DraftSampling.WITHOUT_REPLACEMENT, T1, PEAKY_DRAFT_LOGITS, id="tree-swor-peaky"
    ),
    pytest.param(
        BRANCHING, DraftSampling.WITHOUT_REPLACEMENT, WARPED, DRAFT_LOGITS, id="tree-swor-warped"
    ),
    # Budget 10 keeps every grown node (2 + 2 * 2 + 2 * 2): the frontier is still chosen by
    # score at depth 2, but nothing drafted is dropped.
    pytest.param(
        DynamicTree(top_k=2, depth=3, budget=10),
        DraftSampling.WITHOUT_REPLACEMENT,
        T1,
        DRAFT_LOGITS,
        id="dyn-swor-unpruned",
    ),
    # Budget 3 of 12 grown nodes, chosen by their ranks' values: still verified as draws.
    pytest.param(
        DynamicTree(top_k=3, depth=2, budget=3),
        DraftSampling.WITHOUT_REPLACEMENT,
        T1,
        DRAFT_LOGITS,
        id="dyn-swor-pruned",
    ),
    pytest.param(DynamicTree(3, 3, 4), SAMPLED, T1, PEAKY_DRAFT_LOGITS, id="dyn-swor-pruned-peaky"),
]

# A chain as the context proposes it: point masses grafted beside the draws. Token 0 is likely
# under the target at the root (0.22) and seldom drawn (0.01), so the chain is both accepted
# and rejected.
CHAIN_OF_CONTEXT = (ContextChain(tokens=(0, 4, 1), scores=(-0.5, -1.0, -1.5)),)


@pytest.mark.parametrize(("spec", "sampling", "params", "draft"), CASES)
def test_committed_tokens_have_target_distribution(
    spec: TreeSpec, sampling: DraftSampling, params: SamplingParams, draft: torch.Tensor
) -> None:
    first, pairs, verdicts, trees = _run(spec, sampling, params, draft_table=draft)
    if sampling is DraftSampling.WITHOUT_REPLACEMENT:  # verified as draws, not point masses
        assert all(t.sampling is DraftSampling.WITHOUT_REPLACEMENT for t in trees)
    first_p, second_p = _fit(first, pairs, params)
    # The draft differs from the target, so both acceptance and rejection must happen, or the
    # test would not exercise the residuals.
    accepted = sum(v.num_drafted_accepted > 0 for v in verdicts)
    assert 0 < accepted < len(verdicts)
    assert first_p > P_VALUE_FLOOR, f"first token: p = {first_p:.2e}"
    assert second_p > P_VALUE_FLOOR, f"second token given the first: p = {second_p:.2e}"


@pytest.mark.parametrize(
    "spec", [BRANCHING, DynamicTree(top_k=3, depth=3, budget=5)], ids=["static", "dynamic"]
)
def test_draws_and_grafted_chains_together_have_target_distribution(spec: TreeSpec) -> None:
    """A sampled tree with a context chain: the chain's point masses are tried after the drawn
    siblings, the draws with their proposals, and the committed tokens keep the target's law."""
    first, pairs, verdicts, trees = _run(
        spec, DraftSampling.WITHOUT_REPLACEMENT, T1, context=CHAIN_OF_CONTEXT
    )
    assert all(t.sampling is DraftSampling.WITHOUT_REPLACEMENT for t in trees)
    on_chain = [
        bool(t.point_mass[v.accepted[1]])
        for t, v in zip(trees, verdicts, strict=True)
        if len(v.accepted) > 1
    ]
    assert any(on_chain) and not all(on_chain)  # both kinds of node get accepted
    first_p, second_p = _fit(first, pairs, T1)
    assert first_p > P_VALUE_FLOOR, f"first token: p = {first_p:.2e}"
    assert second_p > P_VALUE_FLOOR, f"second token given the first: p = {second_p:.2e}"


@pytest.mark.parametrize("sampling", [SAMPLED, TOPK_DRAWS])
def test_adaptive_trees_have_target_distribution(sampling: DraftSampling) -> None:
    """An adaptive tree sized per step: sampled draws by the sizer's stopping rule (verified as
    draws), top-k drafts by its best count (point masses). On this cost curve the sizer keeps
    2-4 of the sampled tree's grown nodes, as their scores say."""
    sizer = TreeSizer(CostCurve(sizes=(1, 2, 8), seconds=(1.0, 1.1, 1.6)))
    spec = DynamicTree(top_k=3, depth=3, budget=8, adaptive=True)
    generator = torch.Generator().manual_seed(0)
    plan = DraftPlan(tree=spec, sampling=sampling, params=T1, sizer=sizer)
    first = torch.zeros(VOCAB, dtype=torch.long)
    pairs = torch.zeros(VOCAB, VOCAB, dtype=torch.long)
    sizes = set()
    for _ in range(TRIALS):
        tree = grow_tree(ROOT, _draft_expand(DRAFT_LOGITS), plan, generator)
        assert tree.sampling is sampling
        sizes.add(tree.size)
        verdict = verify_sampling(tree, _target_logits(tree), T1, generator)
        committed = [*tree.tokens[verdict.accepted[1:]].tolist(), verdict.bonus]
        first[committed[0]] += 1
        if len(committed) > 1:
            pairs[committed[0], committed[1]] += 1
    assert len(sizes) > 1 or sampling is TOPK_DRAWS  # top-k drafts: one tree, one count
    first_p, second_p = _fit(first, pairs, T1)
    assert first_p > P_VALUE_FLOOR, f"first token: p = {first_p:.2e}"
    assert second_p > P_VALUE_FLOOR, f"second token given the first: p = {second_p:.2e}"


def test_negative_control_draws_kept_for_their_own_values_fail_the_check(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Scored by the token each drew (not its rank), a budget keeps the draws that drew well:
    verified as draws of their proposals, the committed tokens leave the target's law. This is
    why sampled children are scored by rank."""
    real = grow.draw_children

    def scored_by_own_token(logits, k, plan, generator):
        tokens, _, probs = real(logits, k, plan, generator)
        own = torch.log_softmax(logits.float(), -1).gather(-1, tokens.clamp(min=0))
        return tokens, torch.where(tokens >= 0, own, float("-inf")), probs

    monkeypatch.setattr(grow, "draw_children", scored_by_own_token)
    spec = DynamicTree(top_k=3, depth=2, budget=2)
    first, pairs, _, trees = _run(
        spec, DraftSampling.WITHOUT_REPLACEMENT, T1, draft_table=PEAKY_DRAFT_LOGITS
    )
    assert all(t.sampling is DraftSampling.WITHOUT_REPLACEMENT for t in trees)
    assert min(_fit(first, pairs, T1)) < P_VALUE_FLOOR


@pytest.mark.parametrize("sampling", list(DraftSampling))
def test_zero_target_mass_is_never_committed(sampling: DraftSampling) -> None:
    """The target gives zero mass (top-k 2 of a table that ranks the draft's tokens last)."""
    draft = torch.zeros(MAX_DEPTH, VOCAB, VOCAB)
    draft[..., :3] = 5.0  # the draft proposes tokens 0, 1, 2
    target = torch.zeros(MAX_DEPTH, VOCAB, VOCAB)
    target[..., 3:] = torch.tensor([2.0, 1.0, 0.0])  # target top-2 = {3, 4}
    params = SamplingParams(temperature=1.0, top_k=2)
    first, _, verdicts, trees = _run(
        BRANCHING, sampling, params, trials=300, draft_table=draft, target_table=target
    )
    assert all(set(t.tokens[1:].tolist()) <= {0, 1, 2} for t in trees)  # the premise
    assert all(v.accepted.tolist() == [0] for v in verdicts)
    assert first[:3].sum() == 0 and first[5] == 0
    assert first[3] > 0 and first[4] > 0


def test_draft_equal_to_target_accepts_to_a_leaf() -> None:
    """Without replacement, q == p makes the first child's ratio p/q == 1 at every level."""
    first, pairs, verdicts, trees = _run(
        BRANCHING,
        DraftSampling.WITHOUT_REPLACEMENT,
        T1,
        trials=300,
        draft_table=TARGET_LOGITS,
    )
    for verdict, tree in zip(verdicts, trees, strict=True):
        path = verdict.accepted.tolist()
        assert len(path) == BRANCHING.depth + 1
        assert all(int(tree.draw_ranks[n]) == 0 for n in path[1:])
    assert _fit(first, pairs, T1)[0] > P_VALUE_FLOOR


def test_point_mass_target_equal_to_top1_draft_accepts_to_a_leaf() -> None:
    """Top-k drafts are point masses: accepted for sure only when the target is one too."""
    params = SamplingParams(temperature=1.0, top_k=1)
    _, _, verdicts, trees = _run(
        CHAIN, DraftSampling.TOP_K, params, trials=50, draft_table=TARGET_LOGITS
    )
    for verdict, tree in zip(verdicts, trees, strict=True):
        assert verdict.accepted.tolist() == [0, 1, 2, 3]
        assert verdict.bonus == int(_target_logits(tree)[3].argmax())


def test_seeded_verification_repeats() -> None:
    one = _run(BRANCHING, DraftSampling.WITHOUT_REPLACEMENT, T1, trials=40, seed=5)[2]
    two = _run(BRANCHING, DraftSampling.WITHOUT_REPLACEMENT, T1, trials=40, seed=5)[2]
    other = _run(BRANCHING, DraftSampling.WITHOUT_REPLACEMENT, T1, trials=40, seed=6)[2]

    def key(verdicts: list[Verdict]) -> list[tuple[tuple[int, ...], int]]:
        return [(tuple(v.accepted.tolist()), v.bonus) for v in verdicts]

    assert key(one) == key(two)
    assert key(one) != key(other)


# -- negative controls: the same check has the power to reject wrong verifiers --------------------


def _walk(
    tree: Tree,
    target_logits: torch.Tensor,
    params: SamplingParams,
    generator: torch.Generator,
    defect: str,
) -> Verdict:
    """Recursive rejection sampling with one deliberate defect."""
    target_probs = warp_probs(target_logits, params)  # [T, vocab]
    children = tree.children()
    node, path = 0, [0]
    while True:
        residual = target_probs[node]
        chosen = None
        for child in children[node]:
            token = int(tree.tokens[child])
            if defect == "accept_every_draft":
                chosen = child
                break
            row = int(tree.expanded_row[node])
            if tree.sampling is DraftSampling.TOP_K:
                proposal = torch.zeros_like(residual)
                proposal[token] = 1.0
            else:
                proposal = tree.draft_probs[row].clone()
                if defect != "ignore_without_replacement":
                    earlier = tree.draws[row, : int(tree.draw_ranks[child])]
                    proposal[earlier[earlier >= 0]] = 0.0
                    proposal = proposal / proposal.sum()
            uniform = float(torch.rand((), generator=generator))
            if uniform * float(proposal[token]) < float(residual[token]):
                chosen = child
                break
            if defect != "forget_residual":
                updated = (residual - proposal).clamp(min=0.0)
                residual = updated / updated.sum() if updated.sum() > 0 else residual
        if chosen is None:
            return Verdict(accepted=torch.tensor(path), bonus=int(sample_from(residual, generator)))
        node = chosen
        path.append(node)


@pytest.mark.parametrize(
    ("defect", "sampling", "draft"),
    [
        ("accept_every_draft", DraftSampling.TOP_K, DRAFT_LOGITS),
        ("forget_residual", DraftSampling.TOP_K, DRAFT_LOGITS),
        ("forget_residual", DraftSampling.WITHOUT_REPLACEMENT, DRAFT_LOGITS),
        # Proposal of the i-th draw taken as the raw draft, earlier draws not removed.
        ("ignore_without_replacement", DraftSampling.WITHOUT_REPLACEMENT, PEAKY_DRAFT_LOGITS),
    ],
    ids=["accept_every_draft", "forget_residual-topk", "forget_residual-swor", "ignore_swor"],
)
def test_negative_control_wrong_verifier_fails_the_check(
    defect: str, sampling: DraftSampling, draft: torch.Tensor
) -> None:
    def wrong(
        tree: Tree, logits: torch.Tensor, params: SamplingParams, generator: torch.Generator
    ) -> Verdict:
        return _walk(tree, logits, params, generator, defect)

    first, pairs, _, _ = _run(BRANCHING, sampling, T1, verifier=wrong, draft_table=draft)
    first_p, second_p = _fit(first, pairs, T1)
    assert min(first_p, second_p) < P_VALUE_FLOOR, (first_p, second_p)
