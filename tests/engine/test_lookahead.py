"""The drafter's look-ahead (pipelined speculation): each branch is the fresh draft from its guess.

The exactness of pipelining rests on this: a pre-drafted block used by the orchestrator must be
the block `draft` would produce from the same context with the same seed. Guesses only decide
which blocks are pre-drafted.
"""

from __future__ import annotations

import pytest
import torch

from specdec.drafting import guess_tokens
from specdec.engine.api import DraftRequest, LookaheadRequest
from specdec.engine.drafter import DrafterEngine
from specdec.errors import InvalidRequest
from specdec.races import race, race_arrivals
from specdec.sampling import SamplingParams, warp_logits

PROMPT = [1, 2, 3, 4, 5]
BLOCK = [6, 2]
T1 = SamplingParams(temperature=1.0)
SAMPLINGS = [T1, SamplingParams(temperature=0.7, top_k=3), SamplingParams(temperature=0.0)]


def plain_logits(model, sequence: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=torch.tensor([sequence])).logits[0, -1].float()


def lookahead(**kwargs) -> LookaheadRequest:
    kwargs.setdefault("session_id", "s")
    kwargs.setdefault("base_len", 0)
    kwargs.setdefault("append", PROMPT + BLOCK)
    kwargs.setdefault("k", 3)
    kwargs.setdefault("sampling", T1)
    kwargs.setdefault("seed", 7)
    return LookaheadRequest(**kwargs)


@pytest.mark.parametrize("strategy", ["sample", "race"])
@pytest.mark.parametrize("sampling", SAMPLINGS, ids=["t1", "topk", "greedy"])
def test_each_branch_is_the_fresh_draft_of_its_hypothesis(draft_model, strategy, sampling):
    context = PROMPT + BLOCK
    engine = DrafterEngine(draft_model)
    result = engine.lookahead(lookahead(sampling=sampling, strategy=strategy, want_distributions=True,
                                        bonus_guesses=3, rejection_guesses=2))
    assert [b.replaces_last for b in result.branches] == [False] * 3 + [True] * 2
    fresh = DrafterEngine(draft_model)  # a separate engine: nothing shared with the look-ahead
    for i, branch in enumerate(result.branches):
        hypothesis = (context[:-1] if branch.replaces_last else context) + [branch.token]
        reference = fresh.draft(DraftRequest(f"ref-{i}", 0, hypothesis, [-1, 0, 1], sampling, 7, strategy,
                                             want_distributions=True))
        assert branch.draft.tokens == reference.tokens
        assert branch.draft.parents == reference.parents == [-1, 0, 1][: len(reference.tokens)]
        torch.testing.assert_close(branch.draft.draft_probs, reference.draft_probs, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("strategy", ["sample", "race"])
def test_guesses_are_the_likeliest_tokens(draft_model, strategy):
    context = PROMPT + BLOCK
    engine = DrafterEngine(draft_model)
    result = engine.lookahead(lookahead(strategy=strategy, bonus_guesses=2, rejection_guesses=3, seed=3))
    bonus = [b.token for b in result.branches if not b.replaces_last]
    replacements = [b.token for b in result.branches if b.replaces_last]
    after, before = plain_logits(draft_model.model, context), plain_logits(draft_model.model, context[:-1])
    if strategy == "sample":
        assert bonus == torch.sort(after, descending=True, stable=True).indices[:2].tolist()
        ranked = torch.sort(before, descending=True, stable=True).indices.tolist()
        expected = [t for t in ranked if t != BLOCK[-1]]
        assert replacements == expected[:3]
    else:  # the first arrivals of the verifier's race at that position, under the draft row
        assert bonus == race_arrivals(race(3, len(context), 8), warp_logits(after, T1), 2)
        arrivals = race_arrivals(race(3, len(context) - 1, 8), warp_logits(before, T1), 4)
        assert replacements == [t for t in arrivals if t != BLOCK[-1]][:3]
    assert BLOCK[-1] not in replacements


def test_guess_tokens_excludes_and_ranks():
    logits = torch.tensor([0.1, 3.0, 2.0, 3.0, -1.0])
    warped = warp_logits(logits, T1)
    assert guess_tokens(logits, warped, 3, "sample") == [1, 3, 2]  # ties: lowest id first
    assert guess_tokens(logits, warped, 2, "sample", exclude=1) == [3, 2]
    assert guess_tokens(logits, warped, 0, "sample") == []
    assert guess_tokens(logits, warped, 9, "sample") == [1, 3, 2, 0, 4]
    e = race(5, 0, 5)
    assert guess_tokens(logits, warped, 2, "race", e, exclude=None) == race_arrivals(e, warped, 2)
    one_hot = warp_logits(logits, SamplingParams(temperature=0.0))  # greedy: a support of one
    assert guess_tokens(logits, one_hot, 3, "race", e) == [1, 3, 2]  # then filled up by logits
    with pytest.raises(ValueError):
        guess_tokens(logits, warped, 1, "race")


def test_session_and_cache_after_a_lookahead(draft_model):
    """The session holds C; a following draft from the first bonus guess reuses its cache entries."""
    engine = DrafterEngine(draft_model)
    result = engine.lookahead(lookahead(bonus_guesses=2, rejection_guesses=1))
    first = result.branches[0]
    assert result.reused_tokens == 0
    context = PROMPT + BLOCK + [first.token] + first.draft.tokens
    again = engine.draft(DraftRequest("s", len(PROMPT + BLOCK), context[len(PROMPT + BLOCK):], [-1], T1, 7))
    # Everything but the last token (always re-forwarded for its row) was in the cache already.
    assert again.reused_tokens == len(context) - 1
    # A rejection branch that comes true: the session rolls back by common prefix, no error.
    other = result.branches[-1]
    assert other.replaces_last
    context = PROMPT + BLOCK[:-1] + [other.token]
    redo = engine.draft(DraftRequest("s", 0, context, [-1, 0], T1, 7, want_distributions=True))
    reference = DrafterEngine(draft_model).draft(DraftRequest("r", 0, context, [-1, 0], T1, 7,
                                                              want_distributions=True))
    assert redo.tokens == reference.tokens


def test_short_branches_and_zero_k(draft_model):
    engine = DrafterEngine(draft_model)
    result = engine.lookahead(lookahead(k=0, bonus_guesses=2, rejection_guesses=1))
    assert len(result.branches) == 3 and all(b.draft.tokens == [] for b in result.branches)
    # Greedy rows have one token of support, but guesses come from the logits: still m guesses.
    greedy = engine.lookahead(lookahead(session_id="g", sampling=SamplingParams(temperature=0.0),
                                        bonus_guesses=3, want_distributions=True))
    assert len(greedy.branches) == 3
    for branch in greedy.branches:
        assert branch.draft.draft_probs.shape == (len(branch.draft.tokens) + 1, 8)
        assert torch.all(branch.draft.draft_probs[-1] == 0)


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"k": -1}, "k"),
        ({"bonus_guesses": 17}, "bonus_guesses"),
        ({"rejection_guesses": -1}, "rejection_guesses"),
        ({"bonus_guesses": 0, "rejection_guesses": 0}, "at least 1"),
        ({"strategy": "beam"}, "strategy"),
        ({"append": [1], "rejection_guesses": 1}, "rejection_guesses"),
        ({"append": [99]}, "append"),
    ],
)
def test_bad_requests_name_the_field(draft_model, change, field):
    engine = DrafterEngine(draft_model)
    with pytest.raises(InvalidRequest, match=field):
        engine.lookahead(lookahead(**change))
