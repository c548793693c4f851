"""Model-free (deterministic) drafts: draw and descend is exact and accepts the most (docs/algorithms.md §15).

A prompt-lookup or suffix-cache drafter is a deterministic function of the context, and each of
its nodes has a one-hot q. The drafters here are such functions: random chains, stars and trees
keyed on the context, a prompt-lookup chain (the continuation of the last token's latest earlier
occurrence) and a suffix-cache trie (the continuations of all its earlier occurrences).

Checked by exact enumeration (tests/core/helpers_enumeration.py; test_fidelity_exact.py explains
the method), through `verify(..., deterministic=True)`, the real dispatch:

- the law of the first L output tokens of repeated iterations equals the target's to 1e-12, for
  token, block and gsd-tree (all routed to draw and descend), on V = 3..6, order-1 and order-2
  targets, every sampling variant, every drafter kind;
- the expected number of accepted drafts equals Σ_nodes Π p along the node's path, the bound no
  exact rule can beat; a rule that accepts more (min(1, 2p)) is caught by the same law check;
- token and block verification with explicit one-hot draft rows have draw and descend's law per
  iteration (so both are exact and accept the bound); gsd-tree too on sequences. On a node with
  several children, gsd-tree's rule reads ONE draft row per node, which can be one-hot at one
  candidate only: it then accepts the second candidate with probability 1 after rejecting the first
  (wrong law; a row uniform over the candidates is wrong too). Recursive rejection with each
  candidate's q one-hot in turn is exact and is draw and descend in law. A one-hot draft MODEL
  through test_fidelity_exact's harness is exact under token, block and rd (rd is defined for
  one-hot q; it is refused for model-free drafts for other reasons, §15);
- ERSD: for every seed and every deterministic tree, even one built from the races themselves, the
  output is target-only race decoding (test_ersd_identity.py's argument);
- refusals: rd, draft rows, a missing RandomSource.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable

import pytest
import torch

from specdec.methods import DETERMINISTIC_METHOD_NAMES, get_method
from specdec.races import race, race_winner
from specdec.randomness import RandomSource, TorchRandomSource
from specdec.trees import DraftTree
from specdec.verification.base import MethodParams, Rows, VerificationError, VerifyResult
from specdec.verification.deterministic import verify_deterministic
from specdec.verification.dispatch import verify
from specdec.verification.lean import LeanDraft

from .helpers_enumeration import enumerate_outcomes, expectation, max_abs_difference
from .helpers_fidelity import TOLERANCE, exact_output_distribution, sequence_shape
from .helpers_toy_models import SAMPLING_VARIANTS, MarkovModel, Warped, random_markov

Context = tuple[int, ...]
Drafter = Callable[[Context], DraftTree]
Rule = Callable[[DraftTree, torch.Tensor, RandomSource], VerifyResult]

VARIANTS = list(SAMPLING_VARIANTS)
DRAW_AND_DESCEND_METHODS = ["token", "block", "gsd-tree"]
PROMPT: Context = (0, 1, 2, 0, 1)  # gives the lookup drafters earlier occurrences to copy
TREE_KINDS = ["chain", "star", "random", "lookup", "suffix"]


# --- deterministic drafters: a tree is a function of the context alone ---------------------------


def _rng(*key: object) -> random.Random:
    return random.Random(repr(key))  # str seeds hash with sha512: the same in every process


def random_tree(kind: str, vocab: int, rng: random.Random) -> DraftTree:
    """A chain, star or random-parent tree; children of one node carry distinct tokens."""
    n = {"chain": rng.randint(0, 4), "star": rng.randint(1, min(4, vocab)), "random": rng.randint(2, 6)}[kind]
    tokens: list[int] = []
    parents: list[int] = []
    for i in range(n):
        parent = {"chain": i - 1, "star": -1}.get(kind, rng.randint(-1, i - 1))
        taken = {tokens[j] for j, p in enumerate(parents) if p == parent}
        if len(taken) == vocab:
            parent, taken = i - 1, set()  # node i − 1 has no child yet
        tokens.append(rng.choice([t for t in range(vocab) if t not in taken]))
        parents.append(parent)
    return DraftTree(tuple(tokens), tuple(parents))


def lookup_chain(context: Context, depth: int = 3) -> DraftTree:
    """Prompt lookup: what followed the latest earlier occurrence of the last token."""
    for j in range(len(context) - 2, -1, -1):
        if context[j] == context[-1]:
            return DraftTree.sequence(context[j + 1 : j + 1 + depth])
    return DraftTree.empty()


def suffix_trie(context: Context, depth: int = 3, width: int = 2) -> DraftTree:
    """Suffix cache: the continuations of every earlier occurrence of the last token, as a trie."""
    tokens: list[int] = []
    parents: list[int] = []
    nodes: dict[tuple[int, int], int] = {}
    for j in range(len(context) - 2, -1, -1):
        if context[j] != context[-1]:
            continue
        parent = -1
        for t in context[j + 1 : j + 1 + depth]:
            node = nodes.get((parent, t))
            if node is None:
                if parents.count(parent) >= width:
                    break
                node = nodes[(parent, t)] = len(tokens)
                tokens.append(t)
                parents.append(parent)
            parent = node
    return DraftTree(tuple(tokens), tuple(parents))


def make_drafter(kind: str, vocab: int, case: object = 0) -> Drafter:
    if kind == "lookup":
        return lookup_chain
    if kind == "suffix":
        return suffix_trie
    return lambda context: random_tree(kind, vocab, _rng(case, kind, context))


def target_rows(target: Warped, context: Context, tree: DraftTree) -> torch.Tensor:
    contexts = [list(context)] + [[*context, *tree.path_tokens(i)] for i in range(len(tree))]
    return target.rows_for(contexts)


def one_hot_rows(tree: DraftTree, vocab: int, several: str = "first") -> torch.Tensor:
    """Draft rows of a deterministic draft: node rows one-hot at their child's token. A node with
    several children gets one row all the same: one-hot at its first child ("first") or uniform over
    its children ("uniform"). Rows of leaves stay zero (no rule may read them)."""
    rows = torch.zeros(len(tree) + 1, vocab, dtype=torch.float64)
    for node in range(-1, len(tree)):
        children = [tree.tokens[c] for c in tree.children(node)]
        if children and several == "first":
            rows[node + 1, children[0]] = 1.0
        elif children:
            rows[node + 1, children] = 1.0 / len(children)
    return rows


# --- rules ---------------------------------------------------------------------------------------


def deterministic_rule(method: str) -> Rule:
    def rule(tree: DraftTree, rows: torch.Tensor, source: RandomSource) -> VerifyResult:
        return verify(method, tree, rows, None, MethodParams(), source, deterministic=True)

    return rule


def one_hot_rule(method: str, several: str = "first") -> Rule:
    def rule(tree: DraftTree, rows: torch.Tensor, source: RandomSource) -> VerifyResult:
        draft = one_hot_rows(tree, int(rows.shape[1]), several)
        return verify(method, tree, rows, draft, MethodParams(), source)

    return rule


def _norm(row: torch.Tensor) -> torch.Tensor:
    return row / row.sum()


def sequential_rejection(factor: float = 1.0) -> Rule:
    """Recursive rejection with each candidate's q one-hot in turn: accept child c with probability
    min(1, factor·P*(c)); on rejection P* ← norm((P* − δ_c)+) (= P* with c removed). factor = 1 is
    exact; factor = 2 accepts more than any exact rule can (a negative control)."""

    def rule(tree: DraftTree, rows: torch.Tensor, source: RandomSource) -> VerifyResult:
        node, tokens, accepted = -1, [], []
        while True:
            p_star = _norm(rows[node + 1].to(torch.float64))
            chosen = None
            for child in tree.children(node):
                x = tree.tokens[child]
                if source.bernoulli(min(1.0, factor * float(p_star[x]))):
                    chosen = child
                    break
                p_star = p_star.clone()
                p_star[x] = 0.0
                p_star = _norm(p_star)
            if chosen is None:
                return VerifyResult([*tokens, source.categorical(p_star)], accepted)
            tokens.append(tree.tokens[chosen])
            accepted.append(chosen)
            node = chosen

    return rule


def greedy_descend(tree: DraftTree, rows: torch.Tensor, source: RandomSource) -> VerifyResult:
    """Broken: descend into the likeliest child without drawing when its p ≥ 0.5, else draw and descend."""
    node, tokens, accepted = -1, [], []
    while True:
        p = _norm(rows[node + 1].to(torch.float64))
        children = tree.children(node)
        best = max(children, key=lambda c: float(p[tree.tokens[c]]), default=None)
        if best is not None and float(p[tree.tokens[best]]) >= 0.5:
            match = best
        else:
            y = source.categorical(p)
            match = next((c for c in children if tree.tokens[c] == y), None)
            if match is None:
                return VerifyResult([*tokens, y], accepted)
        tokens.append(tree.tokens[match])
        accepted.append(match)
        node = match


# --- exact laws ----------------------------------------------------------------------------------


def iteration_law(rule: Rule, tree: DraftTree, rows: torch.Tensor) -> dict[tuple[int, ...], float]:
    """Exact law of the tokens one iteration emits."""
    return enumerate_outcomes(lambda source: tuple(rule(tree, rows, source).tokens))


def output_law(rule: Rule, target: Warped, drafter: Drafter, length: int, prompt: Context = PROMPT):
    """Exact law of the first `length` output tokens of repeated iterations (the drafter reads the
    whole context, so nothing is cached by model state)."""
    frontier: dict[Context, float] = {(): 1.0}
    finished: dict[Context, float] = {}
    while frontier:
        following: dict[Context, float] = {}
        for out, probability in frontier.items():
            context = (*prompt, *out)
            tree = drafter(context)
            for emitted, p_emitted in iteration_law(rule, tree, target_rows(target, context, tree)).items():
                extended = out + emitted
                bucket = finished if len(extended) >= length else following
                key = extended[:length]
                bucket[key] = bucket.get(key, 0.0) + probability * p_emitted
        frontier = following
    return finished


def law_error(rule: Rule, target: Warped, drafter: Drafter, length: int = 3) -> float:
    """Max |law − target law| over the first `length` tokens (the comparison every check uses)."""
    got = output_law(rule, target, drafter, length)
    assert abs(sum(got.values()) - 1.0) < TOLERANCE
    return max_abs_difference(got, target.sequence_distribution(length, PROMPT))


def toy_target(vocab: int, order: int, variant: str, seed: int = 0) -> Warped:
    model = random_markov(vocab, order, seed=3000 + 10 * vocab + order + seed)
    return Warped(model, SAMPLING_VARIANTS[variant])


def acceptance_bound(tree: DraftTree, rows: torch.Tensor) -> float:
    """Σ over nodes of Π p along the node's path: the most an exact rule can accept in expectation."""
    p = rows.to(torch.float64)
    p = p / p.sum(dim=1, keepdim=True)
    reach = [0.0] * len(tree)
    for i, (token, parent) in enumerate(zip(tree.tokens, tree.parents, strict=True)):
        reach[i] = (1.0 if parent < 0 else reach[parent]) * float(p[parent + 1, token])
    return math.fsum(reach)


def expected_accepted(rule: Rule, tree: DraftTree, rows: torch.Tensor) -> float:
    return expectation(enumerate_outcomes(lambda source: rule(tree, rows, source).num_accepted), float)


def random_rows(tree: DraftTree, vocab: int, rng: random.Random) -> torch.Tensor:
    """Random target rows for `tree`, some with zeros, some one-hot (as top-k and T = 0 give)."""
    generator = torch.Generator().manual_seed(rng.randrange(10**9))
    rows = torch.softmax(2.0 * torch.randn(len(tree) + 1, vocab, generator=generator, dtype=torch.float64), 1)
    for r in range(len(rows)):
        style = rng.random()
        if style < 0.2:
            rows[r] = torch.nn.functional.one_hot(torch.tensor(rng.randrange(vocab)), vocab).double()
        elif style < 0.4:
            rows[r, rng.randrange(vocab)] = 0.0
    return rows / rows.sum(dim=1, keepdim=True)


# --- 1. draw and descend is exact -----------------------------------------------------------------


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("kind", TREE_KINDS)
@pytest.mark.parametrize("method", DRAW_AND_DESCEND_METHODS)
def test_draw_and_descend_is_exact(method: str, kind: str, variant: str) -> None:
    """Every method routed to draw and descend, every drafter kind, V = 3..6, orders 1 and 2."""
    for vocab, order in ((3, 2), (4, 1), (5, 1), (6, 1)):
        target = toy_target(vocab, order, variant)
        drafter = make_drafter(kind, vocab, case=(method, variant))
        assert law_error(deterministic_rule(method), target, drafter) < TOLERANCE, (vocab, order)


def _stops_where_it_should(tree: DraftTree, out: tuple[int, ...]) -> bool:
    """out[:-1] is a path of the tree, and out[-1] follows a leaf or is no child of the path's end."""
    node: int | None = -1
    for t in out[:-1]:
        node = next((c for c in tree.children(node) if tree.tokens[c] == t), None)
        if node is None:
            return False
    return all(tree.tokens[c] != out[-1] for c in tree.children(node))


@pytest.mark.parametrize("method", DRAW_AND_DESCEND_METHODS)
def test_one_iteration_is_a_target_draw(method: str) -> None:
    """One iteration, outcome by outcome: every emitted t_1..t_m (a tree path, then one token that
    leaves the tree or follows a leaf) has probability Π_j p(t_j | context, t_<j): each token is a
    draw from its own target row, the leaf's bonus row included."""
    rng = random.Random(31)
    for case in range(40):
        vocab = rng.randint(3, 6)
        target = toy_target(vocab, rng.choice([1, 2]), rng.choice(VARIANTS), seed=case)
        context = (*PROMPT, *(rng.randrange(vocab) for _ in range(rng.randint(0, 2))))
        tree = make_drafter(rng.choice(TREE_KINDS), vocab, case)(context)
        law = iteration_law(deterministic_rule(method), tree, target_rows(target, context, tree))
        assert math.fsum(law.values()) == pytest.approx(1.0, abs=TOLERANCE)
        for out, probability in law.items():
            assert _stops_where_it_should(tree, out)
            assert probability == pytest.approx(target.sequence_probability(out, context), abs=TOLERANCE)


def test_draw_and_descend_longer_output() -> None:
    """L = 5 on V = 3 through trees deep enough to be cut mid-iteration."""
    target = toy_target(3, 2, "T=1", seed=1)
    for kind in ("random", "suffix"):
        drafter = make_drafter(kind, 3, 7)
        assert law_error(deterministic_rule("gsd-tree"), target, drafter, length=5) < TOLERANCE


def test_dispatch_runs_draw_and_descend() -> None:
    """deterministic=True under token, block and gsd-tree is verify_deterministic, draw for draw,
    trees included (the rule does not ask for a sequence)."""
    rng = random.Random(5)
    for case in range(30):
        tree = random_tree(rng.choice(["chain", "star", "random"]), 5, rng)
        rows = random_rows(tree, 5, rng)
        for method in DRAW_AND_DESCEND_METHODS:
            got = verify(
                method,
                tree,
                rows,
                None,
                MethodParams(),
                TorchRandomSource.from_seed(case, "v"),
                deterministic=True,
            )
            want = verify_deterministic(
                tree, Rows(rows, "target"), None, MethodParams(), TorchRandomSource.from_seed(case, "v")
            )
            assert got == want
            assert got.tokens[:-1] == [tree.tokens[n] for n in got.accepted_nodes]
    assert set(DETERMINISTIC_METHOD_NAMES) == {"token", "block", "ersd", "gsd-tree"}
    assert not get_method("rd").takes_deterministic_drafts


# --- 2. optimality: it accepts the bound ----------------------------------------------------------


_token_det = deterministic_rule("token")


def test_draw_and_descend_accepts_the_bound() -> None:
    """E[accepted] = Σ_nodes Π p along the path, on 60 random trees and target rows (V = 3..6)."""
    rng = random.Random(11)
    for _ in range(60):
        vocab = rng.randint(3, 6)
        tree = random_tree(rng.choice(["chain", "star", "random"]), vocab, rng)
        rows = random_rows(tree, vocab, rng)
        bound = acceptance_bound(tree, rows)
        for method in DRAW_AND_DESCEND_METHODS:
            got = expected_accepted(deterministic_rule(method), tree, rows)
            assert got == pytest.approx(bound, abs=TOLERANCE)
        # Node by node: P(node i accepted) = Π p along its path.
        law = enumerate_outcomes(lambda s, t=tree, r=rows: tuple(_token_det(t, r, s).accepted_nodes))
        for node in range(len(tree)):
            reached = math.fsum(pr for path, pr in law.items() if node in path)
            exact = math.prod(float(rows[tree.parents[n] + 1, tree.tokens[n]]) for n in tree.path_to(node))
            assert reached == pytest.approx(exact, abs=TOLERANCE)


def test_ersd_accepts_the_bound_too() -> None:
    """ERSD on a deterministic draft accepts child c exactly when the race winner is c, probability
    p(c): its mean over 4000 seeds lies within 5 standard errors of the bound."""
    rng = random.Random(2)
    tree = random_tree("random", 4, rng)
    rows = random_rows(tree, 4, rng)
    counts = [
        verify("ersd", tree, rows, None, MethodParams(seed=seed), None, deterministic=True).num_accepted
        for seed in range(4000)
    ]
    mean = sum(counts) / len(counts)
    sd = math.sqrt(sum((c - mean) ** 2 for c in counts) / (len(counts) - 1))
    assert abs(mean - acceptance_bound(tree, rows)) < 5 * sd / math.sqrt(len(counts)) + 1e-9


# --- 3. the one-hot forms of the other rules -----------------------------------------------------


@pytest.mark.parametrize("method", DRAW_AND_DESCEND_METHODS)
def test_one_hot_rows_on_sequences_have_draw_and_descend_law(method: str) -> None:
    """token (accept p(x̃), residual norm((p − δ)+)), block (w_i = Π p, h_i, residual
    norm((w_τ p − δ)+)) and gsd-tree (token on a sequence) with explicit one-hot rows: per iteration
    the same law of the emitted tokens as draw and descend, so the same acceptance (the bound)."""
    rng = random.Random(17)
    for _ in range(40):
        vocab = rng.randint(3, 6)
        tree = random_tree("chain", vocab, rng)
        rows = random_rows(tree, vocab, rng)
        want = iteration_law(deterministic_rule(method), tree, rows)
        assert max_abs_difference(iteration_law(one_hot_rule(method), tree, rows), want) < TOLERANCE
        assert expected_accepted(one_hot_rule(method), tree, rows) == pytest.approx(
            acceptance_bound(tree, rows), abs=TOLERANCE
        )


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("method", DRAW_AND_DESCEND_METHODS)
def test_one_hot_rows_on_sequences_are_exact(method: str, variant: str) -> None:
    """The same, as the law of the first 3 output tokens (lookup and random chains)."""
    for vocab, kind in ((3, "lookup"), (4, "chain"), (6, "chain")):
        target = toy_target(vocab, 1, variant)
        assert law_error(one_hot_rule(method), target, make_drafter(kind, vocab)) < TOLERANCE


def _one_hot_model(target: MarkovModel, seed: int) -> MarkovModel:
    """A drafter whose every row is one-hot (a deterministic function of its state)."""
    rng = random.Random(seed)
    rows = {}
    for context, row in target.rows.items():
        rows[context] = torch.zeros_like(row)
        rows[context][rng.randrange(target.vocab)] = 1.0
    return MarkovModel(target.order, target.vocab, rows)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize(
    ("method", "kwargs"),
    [("token", {}), ("block", {}), ("rd", {"a": 0.5, "k_max": 2}), ("rd", {"a": 1.0, "k_max": 2})],
    ids=["token", "block", "rd-0.5", "rd-1"],
)
def test_one_hot_draft_model_through_the_fidelity_harness(method: str, kwargs: dict, variant: str) -> None:
    """The same one-hot q as a draft model in test_fidelity_exact's harness (drafting, RD's coins,
    `verify` without deterministic): token, block and RD (defined for any q, one-hot included) are
    exact; sequences of 2 drafts on order-1 targets, first 3 tokens."""
    for vocab in (3, 5):
        target_model = random_markov(vocab, 1, seed=4000 + vocab)
        target = Warped(target_model, SAMPLING_VARIANTS[variant])
        draft = Warped(_one_hot_model(target_model, seed=vocab))
        got = exact_output_distribution(
            method, () if method == "rd" else sequence_shape(2), target, draft, 3, **kwargs
        )
        assert max_abs_difference(got, target.sequence_distribution(3)) < TOLERANCE


def test_sequential_one_hot_rejection_is_draw_and_descend() -> None:
    """Recursive rejection with each candidate's q one-hot in turn (what gsd-tree would have to do):
    the same law per iteration as draw and descend, on stars and random trees."""
    rng = random.Random(23)
    for _ in range(40):
        vocab = rng.randint(3, 6)
        tree = random_tree(rng.choice(["star", "random"]), vocab, rng)
        rows = random_rows(tree, vocab, rng)
        want = iteration_law(deterministic_rule("gsd-tree"), tree, rows)
        assert max_abs_difference(iteration_law(sequential_rejection(), tree, rows), want) < TOLERANCE


@pytest.mark.parametrize("several", ["first", "uniform"])
def test_gsd_tree_with_one_hot_rows_is_not_exact_on_several_children(several: str) -> None:
    """gsd-tree reads one draft row per node. One-hot at the first candidate a: after a's rejection
    Q* has no mass left, so the next candidate b is accepted with probability 1, and b is emitted with
    probability 1 − p(a) instead of p(b). Uniform over the m candidates: a is accepted with
    min(1, m·p(a)) instead of p(a), and the residual (P − Q)+ then takes b's mass away (here b is
    never emitted). Why the registry routes model-free trees to draw and descend."""
    tree = DraftTree.star([0, 1])
    rows = torch.tensor([[0.3, 0.2, 0.5], [0.2, 0.3, 0.5], [0.6, 0.2, 0.2]], dtype=torch.float64)
    law = iteration_law(one_hot_rule("gsd-tree", several), tree, rows)
    first = {t: sum(p for out, p in law.items() if out[0] == t) for t in range(3)}
    if several == "first":
        assert first == pytest.approx({0: 0.3, 1: 0.7, 2: 0.0}, abs=TOLERANCE)
    else:
        assert first == pytest.approx({0: 0.6, 1: 0.0, 2: 0.4}, abs=TOLERANCE)
    for vocab in (3, 4):
        target = toy_target(vocab, 1, "T=1")
        assert law_error(one_hot_rule("gsd-tree", several), target, make_drafter("star", vocab)) > 1e-3


# --- 4. negative controls -----------------------------------------------------------------------


def _argmax_chain(target: Warped, depth: int = 2) -> Drafter:
    """A perfect lookup: the target's likeliest continuation (so a greedy rule has something to take)."""

    def drafter(context: Context) -> DraftTree:
        tokens: list[int] = []
        for _ in range(depth):
            tokens.append(int(torch.argmax(target.probs([*context, *tokens]))))
        return DraftTree.sequence(tokens)

    return drafter


def test_greedy_descend_is_caught() -> None:
    target = toy_target(3, 1, "T=1")
    assert any(float(row.max()) >= 0.5 and float(row.max()) < 1.0 for row in target.model.rows.values())
    drafter = _argmax_chain(target)
    assert law_error(deterministic_rule("token"), target, drafter) < TOLERANCE
    assert law_error(greedy_descend, target, drafter) > 1e-3


@pytest.mark.parametrize("kind", ["chain", "star", "random"])
def test_accepting_more_than_p_is_caught(kind: str) -> None:
    """min(1, 2·p) beats the bound, and the law check notices; factor 1 passes the same check."""
    target = toy_target(4, 1, "T=1")
    drafter = make_drafter(kind, 4, case="control")
    assert law_error(sequential_rejection(1.0), target, drafter) < TOLERANCE
    assert law_error(sequential_rejection(2.0), target, drafter) > 1e-3
    tree = drafter(PROMPT)
    rows = target_rows(target, PROMPT, tree)
    assert expected_accepted(sequential_rejection(2.0), tree, rows) > acceptance_bound(tree, rows) + 1e-3


# --- 5. ERSD: unchanged, same seed ⇒ target-only race decoding -----------------------------------


def race_decode(target: Warped, seed: int, prompt: Context, length: int) -> list[int]:
    tokens = list(prompt)
    for _ in range(length):
        tokens.append(race_winner(race(seed, len(tokens), target.vocab), target.probs(tokens)))
    return tokens[len(prompt) :]


def ersd_generate(
    target: Warped, drafter: Drafter, seed: int, prompt: Context, length: int
) -> tuple[list[int], int]:
    tokens, accepted = list(prompt), 0
    while len(tokens) - len(prompt) < length:
        context = tuple(tokens)
        tree = drafter(context)
        params = MethodParams(seed=seed, position=len(context))
        rows = target_rows(target, context, tree)
        result = verify("ersd", tree, rows, None, params, None, deterministic=True)
        assert result == verify("ersd", tree, rows, None, params)
        accepted += result.num_accepted
        tokens.extend(result.tokens)
    return tokens[len(prompt) :], accepted


def _oracle(target: Warped, seed: int, vocab: int, rng_key: object) -> Drafter:
    """A tree that knows the races: mostly the race-decoding continuation, with wrong turns and a
    random sibling at some depths. The output must still be race decoding (the identity holds for
    every tree, however it was chosen)."""

    def drafter(context: Context) -> DraftTree:
        rng = _rng(rng_key, context)
        truth = race_decode(target, seed, context, 4)
        tokens: list[int] = []
        parents: list[int] = []
        parent = -1
        for depth in range(rng.randint(0, 4)):
            t = truth[depth] if rng.random() < 0.8 else rng.randrange(vocab)
            if rng.random() < 0.5:  # a sibling drafted before the one followed
                tokens.append(rng.choice([s for s in range(vocab) if s != t]))
                parents.append(parent)
            tokens.append(t)
            parents.append(parent)
            parent = len(tokens) - 1
        return DraftTree(tuple(tokens), tuple(parents))

    return drafter


@pytest.mark.parametrize("case", range(16))
def test_ersd_deterministic_equals_race_decoding(case: int) -> None:
    rng = random.Random(case)
    vocab = rng.randint(3, 6)
    variant = VARIANTS[case % len(VARIANTS)]
    target = toy_target(vocab, rng.choice([1, 2]), variant, seed=case)
    prompt = tuple(rng.randrange(vocab) for _ in range(rng.randint(1, 5)))
    total_accepted = 0
    for seed in range(case * 100, case * 100 + 8):
        for drafter in (
            make_drafter(TREE_KINDS[(case + seed) % len(TREE_KINDS)], vocab, (case, seed)),
            _oracle(target, seed, vocab, (case, seed)),
        ):
            out, accepted = ersd_generate(target, drafter, seed, prompt, 10)
            assert out == race_decode(target, seed, prompt, len(out)), seed
            total_accepted += accepted
    assert total_accepted > 0


def _ersd_argmax_override(tree: DraftTree, rows: torch.Tensor, params: MethodParams) -> list[int]:
    """Broken ERSD: descend into a child that is the target's argmax without asking the race."""
    node, depth, tokens = -1, 0, []
    while True:
        row = rows[node + 1]
        children = tree.children(node)
        best = next((c for c in children if tree.tokens[c] == int(torch.argmax(row))), None)
        if best is None:
            winner = race_winner(race(params.seed, params.position + depth, len(row)), row)
            tokens.append(winner)
            best = next((c for c in children if tree.tokens[c] == winner), None)
            if best is None:
                return tokens
        else:
            tokens.append(tree.tokens[best])
        node, depth = best, depth + 1


def test_ersd_identity_catches_a_rule_that_overrides_the_race() -> None:
    """Control: the identity check notices a rule that accepts the argmax draft without its race."""
    target = toy_target(4, 1, "T=1")
    drafter = _argmax_chain(target, depth=3)
    mismatches = 0
    for seed in range(20):
        tokens: list[int] = []
        while len(tokens) < 8:
            context = tuple(tokens)
            tree = drafter(context)
            params = MethodParams(seed=seed, position=len(context))
            tokens.extend(_ersd_argmax_override(tree, target_rows(target, context, tree), params))
        mismatches += tokens != race_decode(target, seed, (), len(tokens))
    assert mismatches > 0


def _rows(rows: torch.Tensor) -> Rows:
    return Rows(rows, "target")


# --- 6. refusals ------------------------------------------------------------------------------------


def _small_case() -> tuple[DraftTree, torch.Tensor]:
    tree = DraftTree.sequence([1, 2])
    rows = torch.full((3, 4), 0.25, dtype=torch.float64)
    return tree, rows


def test_rd_has_no_deterministic_rule() -> None:
    tree, rows = _small_case()
    source = TorchRandomSource.from_seed(0, "v")
    with pytest.raises(VerificationError, match=r"'rd'.*deterministic"):
        verify("rd", tree, rows, None, MethodParams(a=0.5, k_max=2), source, deterministic=True)


@pytest.mark.parametrize("method", ["token", "block", "gsd-tree", "ersd", "rd"])
def test_deterministic_refuses_draft_rows(method: str) -> None:
    tree, rows = _small_case()
    source = TorchRandomSource.from_seed(0, "v")
    for draft in (one_hot_rows(tree, 4), LeanDraft((1.0, 1.0))):
        with pytest.raises(VerificationError, match="no draft rows"):
            verify(method, tree, rows, draft, MethodParams(), source, deterministic=True)


def test_draw_and_descend_needs_a_source() -> None:
    tree, rows = _small_case()
    for method in DRAW_AND_DESCEND_METHODS:
        with pytest.raises(VerificationError, match="RandomSource"):
            verify(method, tree, rows, None, MethodParams(), None, deterministic=True)
    with pytest.raises(VerificationError, match="RandomSource"):
        verify_deterministic(tree, _rows(rows), None, MethodParams(), None)
    # ERSD needs none: its races are keyed on (seed, position).
    assert len(verify("ersd", tree, rows, None, MethodParams(), None, deterministic=True).tokens) >= 1
    with pytest.raises(VerificationError, match="verifies no drafts"):
        verify("autoregressive", tree, rows, None, MethodParams(), None, deterministic=True)
