"""The `verify` entry point: greedy behaviour, input validation, result fields, method relations."""

from __future__ import annotations

import pytest
import torch

from specdec.methods import SPECULATIVE_METHOD_NAMES as METHODS
from specdec.randomness import TorchRandomSource
from specdec.sampling import SamplingParams, warp_logits
from specdec.trees import DraftTree
from specdec.verification.base import MethodParams, Rows, VerificationError, VerifyResult
from specdec.verification.dispatch import verify
from specdec.verification.rd import leading_heads

from .helpers_enumeration import enumerate_outcomes, max_abs_difference

V = 6
GREEDY = SamplingParams(temperature=0.0)


def random_rows(n: int, seed: int, vocab: int = V, sampling: SamplingParams | None = None) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    logits = 2.0 * torch.randn(n, vocab, generator=generator)
    return warp_logits(logits, sampling or SamplingParams())


def one_hot_rows(tokens: list[int], vocab: int = V) -> torch.Tensor:
    return torch.nn.functional.one_hot(torch.tensor(tokens), vocab).to(torch.float32)


def source(seed: int = 0) -> TorchRandomSource:
    return TorchRandomSource.from_seed(seed, "test")


# --- greedy: exact matching ----------------------------------------------------------------------

SEQUENCE_METHODS = [
    ("token", MethodParams()),
    ("block", MethodParams()),
    ("gsd-tree", MethodParams()),
    ("ersd", MethodParams(seed=5, position=3)),
    ("rd", MethodParams(a=1.0, k_max=3)),
    ("rd", MethodParams(a=0.5, k_max=3)),
]


@pytest.mark.parametrize(("method", "params"), SEQUENCE_METHODS)
@pytest.mark.parametrize("mismatch_at", [0, 1, 2, None])
def test_greedy_sequence_is_exact_matching(
    method: str, params: MethodParams, mismatch_at: int | None
) -> None:
    """T = 0 rows from warp_logits: accept the longest prefix matching the target's argmax."""
    for seed in range(5):
        target = random_rows(4, seed, sampling=GREEDY)
        argmax = target.argmax(dim=1).tolist()
        drafts = argmax[:3]
        if mismatch_at is not None:
            drafts[mismatch_at] = (drafts[mismatch_at] + 1) % V
        tree = DraftTree.sequence(drafts)
        draft = one_hot_rows(drafts + [0])  # a greedy drafter's rows (its last row is unused)
        result = verify(method, tree, target, draft, params, source(seed))
        stop = 3 if mismatch_at is None else mismatch_at
        assert result.tokens == argmax[: stop + 1]
        assert result.accepted_nodes == list(range(stop))


def test_greedy_rd_without_drafts_and_short_k() -> None:
    target = random_rows(3, 1, sampling=GREEDY)
    argmax = target.argmax(dim=1).tolist()
    assert verify(
        "rd", DraftTree.empty(), target[:1], None, MethodParams(a=0.0, k_max=2), source()
    ).tokens == [argmax[0]]
    assert verify(
        "rd", DraftTree.empty(), target[:1], one_hot_rows([argmax[0]]), MethodParams(a=0.5, k_max=2), source()
    ).tokens == [argmax[0]]
    tree = DraftTree.sequence(argmax[:2])
    draft = one_hot_rows(argmax)  # K = 2 < k_max = 3: the bonus row is the RD residual
    assert verify("rd", tree, target, draft, MethodParams(a=0.5, k_max=3), source()).tokens == argmax
    assert verify("rd", tree, target, draft, MethodParams(a=1.0, k_max=3), source()).tokens == argmax


@pytest.mark.parametrize("method", ["gsd-tree", "ersd"])
def test_greedy_tree_descends_into_the_matching_child(method: str) -> None:
    # Root children 1, 4, 2; node 1 (token 4) has children 0, 3. Target argmax path: 4, 3, 5.
    tree = DraftTree((1, 4, 2, 0, 3), (-1, -1, -1, 1, 1))
    rows = {-1: 4, 0: 0, 1: 3, 2: 0, 3: 0, 4: 5}
    target = one_hot_rows([rows[i - 1] for i in range(len(tree) + 1)])
    draft = torch.full((len(tree) + 1, V), 1.0 / V)
    result = verify(method, tree, target, draft, MethodParams(seed=1), source())
    assert result.tokens == [4, 3, 5]
    assert result.accepted_nodes == [1, 4]
    assert result.accept_flags == [True, True]
    # Argmax absent among the children: stop at the root with the argmax.
    target2 = target.clone()
    target2[0] = one_hot_rows([5])[0]
    result = verify(method, tree, target2, draft, MethodParams(seed=1), source())
    assert result.tokens == [5] and result.accepted_nodes == [] and result.accept_flags == [False]


# --- result fields -------------------------------------------------------------------------------


@pytest.mark.parametrize("method", METHODS)
def test_result_fields_are_consistent(method: str) -> None:
    tree = (
        DraftTree((1, 2, 3, 0, 5), (-1, -1, 0, 2, 1))
        if method in ("gsd-tree", "ersd")
        else DraftTree.sequence([1, 2, 3])
    )
    params = MethodParams(a=0.6, k_max=4, seed=3, position=7)
    for seed in range(15):
        target = random_rows(len(tree) + 1, seed)
        draft = random_rows(len(tree) + 1, seed + 100)
        result = verify(method, tree, target, draft, params, source(seed))
        assert isinstance(result, VerifyResult)
        assert len(result.tokens) == result.num_accepted + 1
        assert result.tokens[:-1] == [tree.tokens[n] for n in result.accepted_nodes]
        assert all(0 <= t < V for t in result.tokens)
        for parent, child in zip([-1] + result.accepted_nodes, result.accepted_nodes, strict=False):
            assert tree.parents[child] == parent
        flags = result.accept_flags
        assert flags[: result.num_accepted] == [True] * result.num_accepted
        last = result.accepted_nodes[-1] if result.accepted_nodes else -1
        if tree.is_leaf(last):
            assert len(flags) == result.num_accepted  # every depth passed down to a leaf
        else:
            assert flags[result.num_accepted :] == [False]


def test_flags_of_a_full_and_a_rejected_path() -> None:
    target = one_hot_rows([2, 3, 4])
    assert verify(
        "token", DraftTree.sequence([2, 3]), target, target, MethodParams(), source()
    ).accept_flags == [
        True,
        True,
    ]
    result = verify(
        "token", DraftTree.sequence([2, 1]), target, one_hot_rows([2, 1, 0]), MethodParams(), source()
    )
    assert result.accept_flags == [True, False] and result.tokens == [2, 3]


# --- relations between methods -------------------------------------------------------------------


def _iteration_distribution(method: str, k: int, params: MethodParams, seed: int) -> dict:
    target_all = random_rows(k + 1, seed, vocab=4)
    draft_all = random_rows(k + 1, seed + 50, vocab=4)

    def run(src) -> tuple:
        K = leading_heads(params.a, params.k_max, src) if method == "rd" else k
        # Context-free rows by depth keep the example small; the drafts are sampled from them.
        drafts = [src.categorical(draft_all[i].double() / draft_all[i].double().sum()) for i in range(K)]
        tree = DraftTree.sequence(drafts)
        result = verify(method, tree, target_all[: K + 1], draft_all[: K + 1], params, src)
        return tuple(result.tokens), tuple(result.accept_flags)

    return enumerate_outcomes(run)


@pytest.mark.parametrize("k", [1, 2, 3])
def test_rd_with_a_one_is_token_verification(k: int) -> None:
    for seed in range(2):
        rd = _iteration_distribution("rd", k, MethodParams(a=1.0, k_max=k), seed)
        token = _iteration_distribution("token", k, MethodParams(), seed)
        assert max_abs_difference(rd, token) < 1e-15
    # Same draws, same answers: a = 1 makes every RD quantity identical to token verification.
    tree = DraftTree.sequence([1, 2, 3])
    for seed in range(20):
        target, draft = random_rows(4, seed), random_rows(4, seed + 1)
        assert (
            verify("rd", tree, target, draft, MethodParams(a=1.0, k_max=3), source(seed)).tokens
            == verify("token", tree, target, draft, MethodParams(), source(seed)).tokens
        )


def test_gsd_tree_on_a_sequence_is_token_verification() -> None:
    for seed in range(2):
        gsd = _iteration_distribution("gsd-tree", 3, MethodParams(), seed)
        token = _iteration_distribution("token", 3, MethodParams(), seed)
        assert max_abs_difference(gsd, token) < 1e-15


def test_block_accepts_at_least_as_many_as_token() -> None:
    for seed, k in ((0, 2), (1, 2), (2, 3)):
        if True:
            block = _iteration_distribution("block", k, MethodParams(), seed)
            token = _iteration_distribution("token", k, MethodParams(), seed)
            mean = {
                name: sum(p * (len(o[0]) - 1) for o, p in dist.items())
                for name, dist in (("block", block), ("token", token))
            }
            assert mean["block"] >= mean["token"] - 1e-12


def test_unused_leaf_draft_rows_may_be_zero() -> None:
    tree = DraftTree.sequence([1, 2])
    target = random_rows(3, 0)
    draft = random_rows(3, 1)
    draft[2] = 0.0
    for method in ("token", "block", "gsd-tree"):
        verify(method, tree, target, draft, MethodParams(), source())
    verify("rd", tree, target, draft, MethodParams(a=0.5, k_max=2), source())
    with pytest.raises(VerificationError, match="draft row 2"):
        # K = 2 < k_max = 3 reads the draft row after the last draft — unless the path stops early.
        for seed in range(50):
            verify("rd", tree, target, draft, MethodParams(a=0.1, k_max=3), source(seed))


def test_unnormalised_and_float32_rows_are_read_normalised() -> None:
    rows = random_rows(3, 0).to(torch.float32) * 3.0
    view = Rows(rows, "target")
    assert torch.allclose(view.row(1).sum(), torch.tensor(1.0, dtype=torch.float64), atol=1e-15)
    assert view.at([1, 2], [4, 0]) == [float(view.row(1)[4]), float(view.row(2)[0])]
    other = Rows(random_rows(3, 1).double(), "draft")
    expected = [float((w * view.row(i) - other.row(i)).clamp_min(0).sum()) for i, w in ((1, 0.3), (2, 1.0))]
    assert view.positive_mass(other, 1, 3, [0.3, 1.0]) == pytest.approx(expected, rel=1e-14)
    assert view.positive_mass(other, 1, 1, []) == []


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_low_precision_rows_are_read_exactly_as_sent(dtype: torch.dtype) -> None:
    """Rows in any float dtype are read as float64 copies of the values sent."""
    tree = DraftTree.sequence([1, 2, 3])
    target, draft = random_rows(4, 0).to(dtype), random_rows(4, 1).to(dtype)
    for method in ("token", "block", "gsd-tree", "ersd"):
        for seed in range(5):
            low = verify(method, tree, target, draft, MethodParams(seed=seed), source(seed))
            params = MethodParams(seed=seed)
            wide = verify(method, tree, target.double(), draft.double(), params, source(seed))
            assert low.tokens == wide.tokens


# --- input validation ----------------------------------------------------------------------------


SEQ = DraftTree.sequence([1, 2])
STAR = DraftTree.star([1, 2])
P3, Q3 = random_rows(3, 0), random_rows(3, 1)
RD = MethodParams(a=0.5, k_max=2)


@pytest.mark.parametrize(
    ("method", "tree", "target", "draft", "params", "message"),
    [
        ("nope", SEQ, P3, Q3, MethodParams(), "unknown verification method"),
        ("token", SEQ, P3[:2], Q3, MethodParams(), "target distributions must have shape"),
        ("token", SEQ, P3[0], Q3, MethodParams(), "shape"),
        ("token", SEQ, P3, random_rows(4, 1), MethodParams(), "draft distributions must have shape"),
        ("token", SEQ, P3, None, MethodParams(), "draft distributions are required"),
        ("block", SEQ, P3, random_rows(3, 1, vocab=7), MethodParams(), "vocabulary"),
        ("token", DraftTree.sequence([1, 9]), P3, Q3, MethodParams(), "outside"),
        ("token", STAR, P3, Q3, MethodParams(), "sequences only"),
        ("block", STAR, P3, Q3, MethodParams(), "sequences only"),
        ("rd", STAR, P3, Q3, RD, "sequences only"),
        ("rd", SEQ, P3, Q3, MethodParams(a=1.5, k_max=2), r"\[0, 1\]"),
        ("rd", SEQ, P3, Q3, MethodParams(a=-0.1, k_max=2), r"\[0, 1\]"),
        ("rd", SEQ, P3, Q3, MethodParams(a=float("nan"), k_max=2), r"\[0, 1\]"),
        ("rd", SEQ, P3, Q3, MethodParams(a=0.5, k_max=1), "k_max"),
        ("rd", SEQ, P3, Q3, MethodParams(a=0.5, k_max=0), "k_max >= 1"),
        ("rd", SEQ, P3, None, MethodParams(a=0.0, k_max=2), "a = 0 never drafts"),
        ("token", SEQ, torch.zeros(3, V), Q3, MethodParams(), "not a distribution"),
        ("ersd", SEQ, torch.zeros(3, V), None, MethodParams(), "no positive mass"),
        ("ersd", SEQ, P3, None, MethodParams(position=-1), "position"),
        ("token", SEQ, -P3, Q3, MethodParams(), "not a distribution"),
        ("token", SEQ, P3.long(), Q3, MethodParams(), "floating point"),
    ],
)
def test_invalid_inputs_raise(method, tree, target, draft, params, message) -> None:
    with pytest.raises(VerificationError, match=message):
        verify(method, tree, target, draft, params, source())


def test_negative_entries_are_rejected() -> None:
    target = random_rows(1, 0).double()
    target[0, 0] = -0.1
    target[0, 1] += 0.1
    with pytest.raises(VerificationError, match="negative"):
        verify("token", DraftTree.empty(), target, random_rows(1, 1), MethodParams(), source())


def test_source_is_required_except_for_ersd() -> None:
    with pytest.raises(VerificationError, match="RandomSource"):
        verify("token", SEQ, random_rows(3, 0), random_rows(3, 1), MethodParams(), None)
    assert len(verify("ersd", SEQ, random_rows(3, 0), None, MethodParams()).tokens) >= 1


def test_leading_heads() -> None:
    assert leading_heads(1.0, 4, source()) == 4
    assert leading_heads(0.0, 4, source()) == 0
    dist = enumerate_outcomes(lambda src: leading_heads(0.5, 3, src))
    assert dist == pytest.approx({0: 0.5, 1: 0.25, 2: 0.125, 3: 0.125})
    with pytest.raises(VerificationError):
        leading_heads(1.2, 3, source())
    with pytest.raises(VerificationError):
        leading_heads(0.5, 0, source())


def test_empty_tree_samples_the_target() -> None:
    params = MethodParams(a=0.5, k_max=1)
    for method in METHODS:
        dist = enumerate_outcomes(
            lambda src, m=method: tuple(
                verify(
                    m, DraftTree.empty(), random_rows(1, 0, vocab=4), random_rows(1, 1, vocab=4), params, src
                ).tokens
            )
        )
        if method == "ersd":
            assert len(dist) == 1  # deterministic given the race
        elif method == "rd":
            continue  # K = 0 < k_max emits the RD residual, covered by the fidelity tests
        else:
            expected = random_rows(1, 0, vocab=4)[0].double()
            expected = expected / expected.sum()
            assert max_abs_difference(dist, {(t,): float(expected[t]) for t in range(4)}) < 1e-15
