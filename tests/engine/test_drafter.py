"""The drafter engine: same drafts as the reference draft_tree, correct rows, cache reuse, errors."""

from __future__ import annotations

import pytest
import torch

from specdec.drafting import draft_tree
from specdec.engine.api import DRAFT_STRATEGIES, DraftFeatures, DraftRequest
from specdec.engine.drafter import STRATEGIES
from specdec.errors import ContextTooLong, InvalidRequest, SessionGone
from specdec.randomness import TorchRandomSource
from specdec.sampling import SamplingParams, warp_logits
from specdec.trees import DraftTree, optimal_tree_shape

PROMPT = [1, 2, 3, 4, 5]
T1 = SamplingParams(temperature=1.0)



def plain_row(model, sequence: list[int], sampling: SamplingParams) -> torch.Tensor:
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([sequence])).logits[0, -1].float()
    return warp_logits(logits, sampling)


def request(session: str, base: int, append: list[int], shape: list[int], **kwargs) -> DraftRequest:
    kwargs.setdefault("sampling", T1)
    kwargs.setdefault("seed", 11)
    return DraftRequest(session, base, append, shape, **kwargs)


SHAPES = {
    "sequence": [-1, 0, 1, 2],
    "star": [-1, -1, -1],
    "optimal": optimal_tree_shape([0.6, 0.25, 0.1], 8),
    "not-level-ordered": [-1, 0, 1, -1, 3, 0],
}


SAMPLINGS = [T1, SamplingParams(temperature=0.7, top_k=3), SamplingParams(top_p=0.6)]


@pytest.mark.parametrize("strategy", ["sample", "race"])
@pytest.mark.parametrize("shape_name", list(SHAPES))
def test_drafts_equal_the_reference(draft_model, drafter, strategy, shape_name):
    shape = SHAPES[shape_name]
    for case, (sampling, seed) in enumerate(
        [(SAMPLINGS[0], 0), (SAMPLINGS[0], 5), (SAMPLINGS[1], 1), (SAMPLINGS[2], 2)]
    ):
        session = f"{strategy}-{shape_name}-{case}"
        result = drafter.draft(
            request(
                session,
                0,
                PROMPT,
                shape,
                sampling=sampling,
                seed=seed,
                strategy=strategy,
                want_distributions=True,
            )
        )
        tree = DraftTree(tuple(result.tokens), tuple(result.parents))  # valid tree (distinct siblings)
        assert result.draft_probs.shape == (len(tree) + 1, 8)
        rows = {(): result.draft_probs[0]}
        for node in range(len(tree)):
            rows[tuple(tree.path_tokens(node))] = result.draft_probs[node + 1]

        def q_of_path(path: list[int], rows=rows) -> torch.Tensor:
            return rows[tuple(path)]

        source = TorchRandomSource.from_seed(seed, "draft", len(PROMPT))
        reference, used = draft_tree(shape, q_of_path, strategy, source, seed=seed, position=len(PROMPT))
        assert (list(reference.tokens), list(reference.parents)) == (result.tokens, result.parents)
        if case in (0, 2):  # every row used is the model's row after that path (plain forwards)
            for node, row in used.items():
                path = [] if node < 0 else tree.path_tokens(node)
                expected = plain_row(draft_model.model, PROMPT + path, sampling)
                torch.testing.assert_close(row, expected, atol=1e-5, rtol=0)


def test_support_running_out_renumbers_like_the_reference(drafter):
    sampling = SamplingParams(top_k=2)
    shape = [-1, -1, -1, 0, 1, 2]  # the third root child cannot exist with top-2: its subtree goes too
    result = drafter.draft(request("s", 0, PROMPT, shape, sampling=sampling, want_distributions=True))
    assert len(result.tokens) == 4 and result.parents == [-1, -1, 0, 1]


def test_empty_shape_returns_row_zero_only(draft_model, drafter):
    result = drafter.draft(request("s", 0, PROMPT, [], want_distributions=True))
    assert result.tokens == [] and result.parents == []
    assert result.draft_probs.shape == (1, 8)
    torch.testing.assert_close(
        result.draft_probs[0], plain_row(draft_model.model, PROMPT, T1), atol=1e-5, rtol=0
    )
    assert drafter.draft(request("s2", 0, PROMPT, [])).draft_probs is None


def test_leaf_rows(draft_model, drafter):
    shape = [-1, 0, -1]
    without = drafter.draft(request("a", 0, PROMPT, shape, want_distributions=True))
    assert without.draft_probs[2].sum() == 0 and without.draft_probs[3].sum() == 0  # leaves: nodes 1, 2
    with_rows = drafter.draft(request("b", 0, PROMPT, shape, want_distributions=True, include_leaf_rows=True))
    assert (with_rows.tokens, with_rows.parents) == (without.tokens, without.parents)
    tree = DraftTree(tuple(with_rows.tokens), tuple(with_rows.parents))
    for node in range(3):
        expected = plain_row(draft_model.model, PROMPT + tree.path_tokens(node), T1)
        torch.testing.assert_close(with_rows.draft_probs[node + 1], expected, atol=1e-5, rtol=0)


def test_accepted_drafts_are_reused_not_recomputed(draft_model, drafter):
    k = 4
    seq = list(range(-1, k - 1))
    first = drafter.draft(request("s", 0, PROMPT, seq, want_distributions=True))
    assert first.reused_tokens == 0
    L = len(PROMPT)
    # All four accepted + one extra: the first three drafts were forwarded, so L + 3 are reused.
    committed = PROMPT + first.tokens + [0]
    second = drafter.draft(request("s", L, first.tokens + [0], seq, want_distributions=True))
    assert second.reused_tokens == L + k - 1
    # Its rows are still the model's rows for the new sequence.
    torch.testing.assert_close(
        second.draft_probs[0], plain_row(draft_model.model, committed, T1), atol=1e-5, rtol=0
    )
    # Partial acceptance: two drafts, then a token different from the third draft.
    other = (second.tokens[2] + 1) % 8
    third = drafter.draft(
        request(
            "s",
            len(committed),
            second.tokens[:2] + [other],
            seq,
            want_distributions=True,
            include_leaf_rows=True,
        )
    )
    assert third.reused_tokens == len(committed) + 2
    committed = committed + second.tokens[:2] + [other]
    torch.testing.assert_close(
        third.draft_probs[0], plain_row(draft_model.model, committed, T1), atol=1e-5, rtol=0
    )
    # With leaf rows every draft is cached, so full acceptance reuses all k.
    fourth = drafter.draft(request("s", len(committed), third.tokens + [3], [-1]))
    assert fourth.reused_tokens == len(committed) + k
    assert fourth.forward_seconds > 0


def test_tree_drafting_keeps_the_first_path(drafter):
    first = drafter.draft(request("s", 0, PROMPT, [-1, -1, 0, 0, 2]))
    tree = DraftTree(tuple(first.tokens), tuple(first.parents))
    first_path = tree.path_tokens(2)  # root → node 0 → node 2 (first children); node 4 is a leaf, not cached
    assert tree.path_to(2) == [0, 2]
    second = drafter.draft(request("s", len(PROMPT), first_path + [1], [-1]))
    assert second.reused_tokens == len(PROMPT) + 2


def test_base_len_zero_resets_but_keeps_the_reusable_cache(drafter):
    drafter.draft(request("s", 0, PROMPT, [-1]))
    again = drafter.draft(request("s", 0, PROMPT + [6], [-1]))
    assert again.reused_tokens == len(PROMPT)


def test_session_gone(drafter):
    with pytest.raises(SessionGone):
        drafter.draft(request("nobody", 3, [1], [-1]))
    drafter.draft(request("s", 0, PROMPT, [-1]))
    with pytest.raises(SessionGone, match="resend"):
        drafter.draft(request("s", len(PROMPT) + 1, [1], [-1]))
    assert drafter.stats()["active_sessions"] == 1
    drafter.release("s")
    assert drafter.stats()["released"] == 1
    with pytest.raises(SessionGone):
        drafter.draft(request("s", len(PROMPT), [1], [-1]))


def test_invalid_requests(drafter):
    with pytest.raises(InvalidRequest, match="strategy"):
        drafter.draft(request("s", 0, PROMPT, [-1], strategy="beam"))
    with pytest.raises(InvalidRequest, match="shape_parents"):
        drafter.draft(request("s", 0, PROMPT, [-1, 1]))
    with pytest.raises(InvalidRequest, match="append"):
        drafter.draft(request("s", 0, [1, 8], [-1]))
    with pytest.raises(InvalidRequest, match="append"):
        drafter.draft(request("s", 0, [], [-1]))
    with pytest.raises(ContextTooLong):
        drafter.draft(request("s", 0, [1] * 126, [-1, 0, 1]))  # 126 + depth 3 > 128
    drafter.draft(request("s", 0, [1] * 125, [-1, 0, 1]))


def test_strategies_are_one_table_of_the_declared_names(drafter):
    """The engine dispatches on STRATEGIES, whose names are the declared ones (and the wire's);
    draft-head features in a request are carried, not read: the draft is the same without them."""
    assert tuple(STRATEGIES) == DRAFT_STRATEGIES
    assert all(entry.name == name for name, entry in STRATEGIES.items())
    features = DraftFeatures((3, 4), torch.ones((2, 5)))
    plain = drafter.draft(request("f1", 0, PROMPT, [-1, 0, -1], want_distributions=True))
    fed = drafter.draft(request("f2", 0, PROMPT, [-1, 0, -1], want_distributions=True, features=features))
    assert (fed.tokens, fed.parents) == (plain.tokens, plain.parents)
    assert torch.equal(fed.draft_probs, plain.draft_probs)


def test_info(drafter, draft_model):
    info = drafter.info()
    assert info.vocab_size == 8 and info.max_context == 128 and info.eos_token_ids == (7,)
    assert info is draft_model.info
