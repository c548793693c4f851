"""The verifier engine on tiny models: every method, exact greedy output, score reuse, errors."""

from __future__ import annotations

import threading

import pytest
import torch

from specdec.engine.api import ScoreRequest, VerifyRequest
from specdec.errors import ContextTooLong, InvalidRequest, SessionGone
from specdec.races import race, race_winner
from specdec.sampling import SamplingParams, warp_logits
from specdec.trees import optimal_tree_shape
from specdec.verification.base import MethodParams

from .helpers import committed_of, speculate

PROMPTS = [[1, 2, 3], [4], [0, 5, 6, 7, 1]]
GREEDY = SamplingParams(temperature=0.0)
T1 = SamplingParams(temperature=1.0)
TREE = optimal_tree_shape([0.5, 0.3, 0.1], 7)





def greedy_reference(model, prompt: list[int], n: int) -> list[int]:
    ids = torch.tensor([prompt], device=model.device)
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=n,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
    )
    return out[0].tolist()[len(prompt) :]


LOOPS = {  # method, shape, a, k_max
    "token": ("token", [-1, 0, 1, 2], 1.0, 0),
    "block": ("block", [-1, 0, 1, 2], 1.0, 0),
    "gsd-tree": ("gsd-tree", TREE, 1.0, 0),
    "ersd-seq": ("ersd", [-1, 0, 1], 1.0, 0),
    "ersd-tree": ("ersd", TREE, 1.0, 0),
    "rd": ("rd", [], 0.6, 3),
}


@pytest.mark.device  # on SPECDEC_TEST_DEVICE (tests/conftest.py)
@pytest.mark.parametrize("name", list(LOOPS))
def test_greedy_speculation_equals_plain_greedy_decoding(device_drafter, device_verifier, device_target_model,
                                                         name):
    drafter, verifier, target_model = device_drafter, device_verifier, device_target_model
    method, shape, a, k_max = LOOPS[name]
    n = 14
    for i, prompt in enumerate(PROMPTS):
        expected = greedy_reference(target_model.model, prompt, n)
        # Drafting at T=1 gives real branching and rejections; the greedy target must not care.
        out, stats = speculate(
            drafter,
            verifier,
            f"{name}{i}",
            prompt,
            n,
            method,
            shape,
            GREEDY,
            draft_sampling=T1,
            seed=i,
            a=a,
            k_max=k_max,
            coin_seed=i,
        )
        assert out == expected, (name, prompt)
        assert committed_of(verifier, f"{name}{i}")[len(prompt) : len(prompt) + n] == out
        if method != "rd":
            assert stats.accepted < stats.drafted  # some rejections happened


@pytest.mark.parametrize("method", ["token", "block"])
def test_greedy_with_greedy_drafts(drafter, verifier, target_model, method):
    prompt = PROMPTS[2]
    out, stats = speculate(drafter, verifier, "g", prompt, 12, method, [-1, 0, 1], GREEDY)
    assert out == greedy_reference(target_model.model, prompt, 12)
    assert stats.accepted > 0


@pytest.mark.device  # on SPECDEC_TEST_DEVICE (tests/conftest.py)
def test_ersd_equals_target_only_race_decoding(device_drafter, device_verifier, device_target_model):
    """With a seed, ERSD emits argmin e_n / P_n at every position n, whatever the drafts."""
    drafter, verifier, target_model = device_drafter, device_verifier, device_target_model
    prompt, seed, n = [3, 1, 4], 21, 16
    sequence = list(prompt)
    for _ in range(n):
        with torch.no_grad():
            ids = torch.tensor([sequence], device=target_model.model.device)
            logits = target_model.model(input_ids=ids).logits[0, -1].float().cpu()
        sequence.append(race_winner(race(seed, len(sequence), 8), warp_logits(logits, T1)))
    for shape in ([-1, 0, 1, 2], TREE):
        out, stats = speculate(drafter, verifier, f"e{len(shape)}", prompt, n, "ersd", shape, T1, seed=seed)
        assert out == sequence[len(prompt) :]
        assert stats.accepted > 0


@pytest.mark.parametrize("name", list(LOOPS))
def test_sampling_loops_commit_consistently(drafter, verifier, name):
    method, shape, a, k_max = LOOPS[name]
    prompt = [2, 6, 1]
    out, stats = speculate(drafter, verifier, "s", prompt, 20, method, shape, T1, seed=3, a=a, k_max=k_max)
    assert len(out) == 20 and all(0 <= t < 8 for t in out)
    committed = committed_of(verifier, "s")
    assert committed[: len(prompt) + 20] == prompt + out
    with verifier.sessions.use("s", 1) as session:  # the cache holds every committed token but the last
        assert session.kv.prefix == committed[:-1] and session.kv.block_len == 0
    assert stats.iterations > 1 and stats.verify_reused[0] == 0
    # After the first iteration the verifier forwards only the one committed token it lacks.
    assert stats.verify_reused[1:] == [n - 1 for n in stats.lengths_before[1:]]


def verify_request(session: str, base: int, append: list[int], tokens, parents, method="token", **kwargs):
    kwargs.setdefault("params", MethodParams(seed=1))
    kwargs.setdefault("sampling", T1)
    return VerifyRequest(session, base, append, list(tokens), list(parents), method, **kwargs)


def test_empty_tree_steps(verifier, target_model):
    prompt = [1, 2, 3]
    with torch.no_grad():
        logits = target_model.model(input_ids=torch.tensor([prompt])).logits[0, -1].float()
    # ERSD with no drafts is race sampling of the target.
    out = verifier.verify(verify_request("e", 0, prompt, [], [], "ersd", params=MethodParams(seed=9)))
    assert out.tokens == [race_winner(race(9, 3, 8), warp_logits(logits, T1))]
    assert out.accepted_nodes == [] and out.num_drafted == 0 and out.committed_len == 4
    # Token verification with no drafts needs no draft rows: one plain target sample.
    for method in ("token", "block", "gsd-tree"):
        out = verifier.verify(verify_request(method, 0, prompt, [], [], method))
        assert len(out.tokens) == 1 and out.committed_len == 4
    # RD's no-draft step needs row 0 of the draft.
    with pytest.raises(InvalidRequest, match="draft_probs"):
        verifier.verify(verify_request("rd", 0, prompt, [], [], "rd", params=MethodParams(a=0.5, k_max=2)))
    q = torch.full((1, 8), 1 / 8)
    out = verifier.verify(
        verify_request("rd", 0, prompt, [], [], "rd", params=MethodParams(a=0.5, k_max=2), draft_probs=q)
    )
    assert len(out.tokens) == 1


def test_score_then_verify_reuses_the_forward_pass(verifier):
    prompt, tokens, parents = [1, 2, 3], [4, 5, 6], [-1, 0, -1]
    q = torch.full((4, 8), 1 / 8)
    verifier.score(ScoreRequest("a", 0, prompt, tokens, parents, T1))
    assert verifier.score_hits == 0
    scored = verifier.verify(verify_request("a", 0, prompt, tokens, parents, "gsd-tree", draft_probs=q))
    assert verifier.score_hits == 1 and scored.score_reused is True
    fresh = verifier.verify(verify_request("b", 0, prompt, tokens, parents, "gsd-tree", draft_probs=q))
    assert fresh.score_reused is False and fresh.pending_tokens == len(prompt)
    # The pass's shape goes with the call that ran it (alone: one call, its own rows), never with a
    # verify that reused an earlier Score call's pass.
    assert fresh.pass_calls == 1 and fresh.pass_rows is not None and fresh.pass_rows >= len(tokens)
    assert (scored.pass_calls, scored.pass_rows) == (1, None)
    assert (scored.tokens, scored.accepted_nodes) == (fresh.tokens, fresh.accepted_nodes)
    assert committed_of(verifier, "a") == committed_of(verifier, "b")
    # A score that arrives after its verify is ignored (and does not rewind the session).
    verifier.score(ScoreRequest("a", 0, prompt, tokens, parents, T1))
    assert verifier.late_scores == 1
    assert verifier.stats()["late_scores"] == 1 and verifier.stats()["active_sessions"] == 2
    assert committed_of(verifier, "a") == prompt + scored.tokens
    # A score for a different tree is simply recomputed over by the verify.
    n = len(committed_of(verifier, "a"))
    verifier.score(ScoreRequest("a", n, [], [1], [-1], T1))
    out = verifier.verify(
        verify_request("a", n, [], [2], [-1], "token", draft_probs=torch.full((2, 8), 1 / 8))
    )
    assert not out.score_reused and out.committed_len == n + len(out.tokens)


def test_draft_features_are_declared_but_not_filled(verifier):
    """want_features is accepted and changes nothing else; the engine answers no features yet (its
    scoring pass returns logits only), and without the flag never any."""
    prompt, tokens, parents = [1, 2, 3], [4, 5], [-1, 0]
    q = torch.full((3, 8), 1 / 8)
    plain = verifier.verify(verify_request("nf", 0, prompt, tokens, parents, draft_probs=q))
    asked = verifier.verify(verify_request("wf", 0, prompt, tokens, parents, draft_probs=q,
                                           want_features=True))
    assert plain.features is None and asked.features is None
    assert (asked.tokens, asked.accepted_nodes) == (plain.tokens, plain.accepted_nodes)


def test_score_opening_a_session_counts_as_committed(verifier):
    """RD's first no-draft step opens the session with Score; the Verify that follows names
    the scored context as already held (base_len = its length, nothing appended)."""
    prompt = [1, 2, 3]
    q = torch.full((1, 8), 1 / 8)
    verifier.score(ScoreRequest("opened-by-score", 0, prompt, [], [], T1))
    hits = verifier.score_hits
    out = verifier.verify(
        verify_request("opened-by-score", len(prompt), [], [], [], "rd",
                       params=MethodParams(a=0.0, k_max=1), draft_probs=q)
    )
    assert verifier.score_hits == hits + 1 and out.score_reused
    assert committed_of(verifier, "opened-by-score") == prompt + out.tokens


def test_verify_waits_for_a_running_score(verifier):
    prompt, tokens, parents = [1, 2, 3, 4], [5, 6], [-1, 0]
    q = torch.full((3, 8), 1 / 8)
    results = {}
    score = threading.Thread(target=verifier.score, args=(ScoreRequest("c", 0, prompt, tokens, parents, T1),))
    verify = threading.Thread(
        target=lambda: results.setdefault(
            "v", verifier.verify(verify_request("c", 0, prompt, tokens, parents, "token", draft_probs=q))
        )
    )
    score.start()
    verify.start()
    score.join(30)
    verify.join(30)
    outcome = results["v"]
    # Either order is correct; exactly one forward pass's rows were used, and the state is consistent.
    assert verifier.score_hits + verifier.late_scores == 1
    assert committed_of(verifier, "c") == prompt + outcome.tokens


def test_errors(verifier):
    prompt = [1, 2, 3]
    q = torch.full((3, 8), 1 / 8)
    with pytest.raises(InvalidRequest, match="method"):
        verifier.verify(verify_request("x", 0, prompt, [1, 2], [-1, 0], "nope", draft_probs=q))
    with pytest.raises(InvalidRequest, match="draft_probs"):
        verifier.verify(verify_request("x", 0, prompt, [1, 2], [-1, 0], "token"))
    with pytest.raises(InvalidRequest, match="draft_probs"):
        verifier.verify(
            verify_request("x", 0, prompt, [1, 2], [-1, 0], "token", draft_probs=torch.ones(2, 8))
        )
    with pytest.raises(InvalidRequest, match="draft_probs"):
        verifier.verify(
            verify_request("x", 0, prompt, [1, 2], [-1, 0], "token", draft_probs=torch.ones(3, 9))
        )
    with pytest.raises(InvalidRequest, match="tree_parents"):
        verifier.verify(verify_request("x", 0, prompt, [1, 2], [-1, 1], "token", draft_probs=q))
    with pytest.raises(InvalidRequest, match="tree_parents"):
        verifier.verify(verify_request("x", 0, prompt, [1, 1], [-1, -1], "ersd"))  # repeated siblings
    with pytest.raises(InvalidRequest, match="tree_parents"):
        verifier.verify(verify_request("x", 0, prompt, [1, 2], [-1], "ersd"))
    with pytest.raises(InvalidRequest, match="tree_tokens"):
        verifier.verify(verify_request("x", 0, prompt, [1, 8], [-1, 0], "ersd"))
    with pytest.raises(InvalidRequest, match="append"):
        verifier.verify(verify_request("x", 0, [1, 99], [], [], "ersd"))
    with pytest.raises(InvalidRequest, match="sequences"):  # the method's own check, mapped
        verifier.verify(verify_request("x", 0, prompt, [1, 2], [-1, -1], "token", draft_probs=q))
    with pytest.raises(ContextTooLong):
        verifier.verify(verify_request("x", 0, [1] * 62, [1, 2, 3], [-1, 0, 1], "ersd"))  # 62 + 3 > 64
    verifier.verify(verify_request("x", 0, [1] * 61, [1, 2, 3], [-1, 0, 1], "ersd"))
    with pytest.raises(SessionGone):
        verifier.verify(verify_request("unknown", 4, [1], [], [], "ersd"))
    with pytest.raises(SessionGone):
        verifier.verify(verify_request("x", 1000, [1], [], [], "ersd"))
    with pytest.raises(SessionGone):
        verifier.score(ScoreRequest("unknown", 2, [1], [], [], T1))
    assert verifier.release("x") and not verifier.release("x")


def test_tokenize_decode_and_info(verifier):
    assert verifier.tokenize("t1 t2 t7") == [1, 2, 7]
    assert verifier.decode([1, 2, 3]) == "t1 t2 t3"
    assert verifier.decode([1, 2, 7]) == "t1 t2"  # t7 is the end-of-sequence token: no text
    with pytest.raises(InvalidRequest):
        verifier.decode([8])
    info = verifier.info()
    assert info.vocab_size == 8 and info.max_context == 64
