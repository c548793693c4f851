"""The draft-length controller on simulated iterations: it settles on the analytic optimum of the
timed §7 formula, falls back to target-only when drafting cannot pay, and comes back when it can."""

from __future__ import annotations

import math
import random
import time
from dataclasses import dataclass

import pytest

from orchestrator.adaptation import DraftLength, Observation, PairEstimates, SourceEstimates
from specdec.theory import expected_tokens_per_iteration
from tests.orchestrator.helpers import VirtualClock, slowed_model


@dataclass
class Workload:
    """A simulated model pair: i.i.d. acceptance α, T_p(n) = t_p·(1 + slope·(n − 1)), T_q per token,
    and a fixed overhead per iteration outside the model calls."""

    alpha: float
    t_p: float = 0.09
    slope: float = 0.075
    t_q: float = 0.03
    overhead: float = 0.005
    noise: float = 0.05

    def target(self, n: int) -> float:
        return self.t_p * (1.0 + self.slope * (n - 1))

    def wall(self, k: int) -> float:
        return k * self.t_q + self.target(k + 1) + self.overhead

    def rate(self, k: int) -> float:
        return expected_tokens_per_iteration(self.alpha, k) / self.wall(k)

    def optimum(self, k_max: int) -> int:
        return max(range(k_max + 1), key=self.rate)

    def accepted(self, k: int, rng: random.Random) -> int:
        """Drafts accepted out of k, i.i.d. at rate α up to the first rejection."""
        accepted = 0
        while accepted < k and rng.random() < self.alpha:
            accepted += 1
        return accepted

    def step(
        self, request: DraftLength, rng: random.Random, prefill: float = 0.0, *, steady: bool = True
    ) -> int:
        """One iteration of `request`: its choice, simulated, fed to it and to its pair (`prefill`
        seconds more for an iteration that first takes in a prompt)."""
        k = request.choose()
        accepted = self.accepted(k, rng)
        jitter = lambda x: x * (1.0 + self.noise * (2.0 * rng.random() - 1.0))  # noqa: E731
        observation = Observation(
            drafted=k,
            accepted=accepted,
            wall_seconds=jitter(self.wall(k)) + prefill,
            verify_seconds=jitter(self.target(k + 1)) + prefill,
            draft_seconds=jitter(k * self.t_q),
            steady=steady,
        )
        request.pair.observe(observation)
        request.observe(observation)
        return k

    def run(self, request: DraftLength, iterations: int, rng: random.Random) -> list[int]:
        """Drive one long request for `iterations`; returns the k it chose each time."""
        return [self.step(request, rng) for _ in range(iterations)]


def settled(chosen: list[int], tail: int = 100) -> int:
    """The k chosen most often over the last `tail` iterations."""
    last = chosen[-tail:]
    return max(set(last), key=last.count)


@pytest.mark.parametrize(
    "alpha, t_q, start_k",
    [
        (0.9, 0.01, 2),  # a cheap, accurate drafter: long drafts
        (0.8, 0.02, 2),
        (0.6, 0.015, 4),
        (0.75, 0.03, 1),
    ],
)
def test_settles_on_the_analytic_optimum(alpha: float, t_q: float, start_k: int) -> None:
    work = Workload(alpha=alpha, t_q=t_q)
    k_max = 8
    best = work.optimum(k_max)
    assert best > 0  # these workloads are meant to speculate
    chosen = work.run(DraftLength(PairEstimates(), k_max=k_max, start_k=start_k), 600, random.Random(1))
    k = settled(chosen)
    # Noise may leave it on a neighbour whose rate is within a few percent of the optimum.
    assert k == best or work.rate(k) >= 0.97 * work.rate(best), (
        k,
        best,
        [work.rate(i) for i in range(k_max + 1)],
    )
    achieved = sum(work.rate(c) for c in chosen[-200:]) / 200
    assert achieved >= 0.95 * work.rate(best)


@pytest.mark.parametrize("alpha, t_q", [(0.5, 0.08), (0.3, 0.03), (0.85, 0.2)])
def test_falls_back_to_target_only_when_drafting_cannot_pay(alpha: float, t_q: float) -> None:
    """Small c (a slow drafter) or low acceptance: k = 0, with a probe every probe_every target-only steps."""
    work = Workload(alpha=alpha, t_q=t_q)
    assert work.optimum(8) == 0
    chosen = work.run(DraftLength(PairEstimates(), k_max=8, start_k=2, probe_every=16), 600, random.Random(2))
    assert settled(chosen, 200) == 0
    speculative = sum(1 for k in chosen[-320:] if k > 0)
    assert 0 < speculative <= 320 // 16 + 2  # the probes only
    achieved = sum(work.rate(c) for c in chosen[-320:]) / 320
    assert achieved >= 0.92 * work.rate(0)


def test_returns_to_speculation_when_it_pays_again() -> None:
    """The probes at k = 0 notice a drafter that became fast (say, its device was freed)."""
    rng = random.Random(3)
    slow, fast = Workload(alpha=0.8, t_q=0.2), Workload(alpha=0.8, t_q=0.01)
    request = DraftLength(PairEstimates(), k_max=8, start_k=2)
    assert settled(slow.run(request, 400, rng)) == 0
    chosen = fast.run(request, 400, rng)
    k = settled(chosen)
    assert k > 0 and fast.rate(k) >= 0.97 * fast.rate(fast.optimum(8))


def test_expected_tokens_matches_section_7_for_iid_acceptance() -> None:
    request = DraftLength(PairEstimates(), k_max=8, start_k=2)
    Workload(alpha=0.7).run(request, 2000, random.Random(4))  # mostly k = 2..3: depths 1..3 measured
    for k in (1, 2, 3):
        assert request.expected_tokens(k) == pytest.approx(expected_tokens_per_iteration(0.7, k), rel=0.08)


def test_a_broken_estimate_misses_the_optimum() -> None:
    """Negative check: with acceptance misread (every draft counted as rejected), the controller
    cannot find the optimum of a workload where drafting pays — the tests above can fail."""
    work = Workload(alpha=0.9, t_q=0.01)
    request = DraftLength(PairEstimates(), k_max=8, start_k=2)
    chosen = []
    for _ in range(400):
        k = request.choose()
        chosen.append(k)
        observation = Observation(
            drafted=k,
            accepted=0,
            wall_seconds=work.wall(k),
            verify_seconds=work.target(k + 1),
            draft_seconds=k * work.t_q,
        )
        request.pair.observe(observation)
        request.observe(observation)
    assert settled(chosen) != work.optimum(8)


def test_each_request_follows_its_own_acceptance() -> None:
    """Requests share the pair's timings but not their acceptance: code that the drafter predicts
    well drafts, prose that it does not runs target-only — side by side, interleaved."""
    rng = random.Random(6)
    code, prose = Workload(alpha=0.9, t_q=0.03), Workload(alpha=0.25, t_q=0.03)
    assert code.optimum(8) > 0 and prose.optimum(8) == 0
    pair = PairEstimates()
    for _ in range(6):  # six pairs of 48-iteration requests
        code_request = DraftLength(pair, k_max=8, start_k=2)
        prose_request = DraftLength(pair, k_max=8, start_k=2)
        chosen: dict[str, list[int]] = {"code": [], "prose": []}
        for _ in range(48):
            chosen["code"].append(code.step(code_request, rng))
            chosen["prose"].append(prose.step(prose_request, rng))
    assert settled(chosen["code"], 24) > 0
    assert settled(chosen["prose"], 24) == 0


def test_a_prefill_iteration_teaches_acceptance_not_time() -> None:
    pair = PairEstimates()
    pair.observe(Observation(drafted=2, accepted=2, wall_seconds=5.0, verify_seconds=4.0, draft_seconds=1.0,
                             steady=False))
    assert pair.weight(2) == 0.0 and math.isnan(pair.target_seconds(3))
    assert pair.pooled_alpha() == pytest.approx(1.0)
    pair.observe(Observation(drafted=2, accepted=0, wall_seconds=0.2, verify_seconds=0.1, draft_seconds=0.1))
    assert pair.weight(2) == 1.0 and pair.iteration_seconds(2) == pytest.approx(0.2)


@pytest.mark.parametrize("prefill_is_steady", [False, True])
def test_prompt_prefills_do_not_trap_drafting_requests_target_only(prefill_is_steady: bool) -> None:
    """Short requests, each opening with a 0.8 s prompt prefill in its first (drafted) iteration. Once
    the pair has gone target-only, the openings are its only samples of W(k ≥ 1): counted as times,
    the prefills make drafting look slow for good, even where it pays (the negative case; what the
    mixed-prompt benchmark showed on code before prefills were excluded)."""
    code = Workload(alpha=0.8, t_q=0.045)  # drafting pays 17 % (c = 0.5, like the default pair on a CPU)
    assert code.rate(code.optimum(8)) > 1.15 * code.rate(0)
    later: list[int] = []
    for seed in range(8, 14):  # six runs: a request's own unlucky drafts may keep it target-only a while
        rng, pair = random.Random(seed), PairEstimates()
        for n in range(12):
            request = DraftLength(pair, k_max=8, start_k=2)
            chosen = [code.step(request, rng, 0.8, steady=prefill_is_steady)]
            chosen += [code.step(request, rng) for _ in range(23)]
            if n >= 6:
                later += chosen[12:]
    drafted = sum(1 for k in later if k > 0) / len(later)
    if prefill_is_steady:
        # The bias this guards against. Since a pair that cannot pay skips the openings (which were
        # then the only samples of W(k ≥ 1)), the polluted W(k) fades and drafting resumes in part.
        assert drafted < 0.8, later
    else:
        assert drafted > 0.9, later


@dataclass
class PipelinedWorkload(Workload):
    """Pipelined iterations: one whose draft the look-ahead made during the iteration before (that one
    accepted every draft and its bonus token was guessed, at rate `guess`) waits only for the longer
    of the verifier's pass and the next look-ahead; any other drafts first and pays `miss` seconds
    more (an abandoned look-ahead's wait). So W(k) falls as a request's acceptance rises."""

    guess: float = 0.7
    miss: float = 0.02

    def predrafted_wall(self, k: int) -> float:
        return max(self.target(k + 1), 1.5 * k * self.t_q) + self.overhead

    def fresh_wall(self, k: int) -> float:
        return k * self.t_q + self.target(k + 1) + self.overhead + (self.miss if k else 0.0)

    def wall(self, k: int) -> float:
        """The mean iteration: predrafted with probability α^k · guess."""
        hit = self.alpha**k * self.guess if k else 0.0
        return hit * self.predrafted_wall(k) + (1.0 - hit) * self.fresh_wall(k)

    def run_request(self, request: DraftLength, iterations: int, rng: random.Random) -> list[int]:
        chosen, predrafted = [], None
        for _ in range(iterations):
            k = request.choose()
            accepted = self.accepted(k, rng)
            wall = self.predrafted_wall(k) if k and predrafted == k else self.fresh_wall(k)
            predrafted = k if accepted == k and rng.random() < self.guess else None
            observation = Observation(
                drafted=k,
                accepted=accepted,
                wall_seconds=wall * (1.0 + self.noise * (2.0 * rng.random() - 1.0)),
                verify_seconds=self.target(k + 1),
                draft_seconds=k * self.t_q,
            )
            request.pair.observe(observation)
            request.observe(observation)
            chosen.append(k)
        return chosen


@pytest.mark.parametrize("own_times", [True, False])
def test_a_request_weighs_its_own_iteration_times(own_times: bool) -> None:
    """Chat beside code, pipelined: the pair's W(k) is a mean over both, and the code's look-aheads
    come true more often, so it flatters chat, whose drafting loses. With its own times in W(k)
    (`wall_prior` pseudo-samples of the pair's) a chat request stays near target-only; with the
    pair's alone (the negative case: what the mixed-prompt benchmark showed) it drafts and loses."""
    code = PipelinedWorkload(alpha=0.9, t_q=0.045)
    chat = PipelinedWorkload(alpha=0.45, t_q=0.045, guess=0.6)
    assert code.rate(code.optimum(8)) > 1.4 * code.rate(0)
    assert chat.optimum(8) == 0 and chat.rate(1) < 0.95 * chat.rate(0)
    chat_rates, code_rates = [], []
    for seed in range(1, 5):
        rng, pair = random.Random(seed), PairEstimates()
        for n in range(16):  # code and chat requests of 30 iterations in turn; the last ten counted
            prior = {"wall_prior": 2.0} if own_times else {"wall_prior": 1e9}
            code_k = code.run_request(DraftLength(pair, k_max=8, start_k=2, **prior), 30, rng)
            chat_k = chat.run_request(DraftLength(pair, k_max=8, start_k=2, **prior), 30, rng)
            if n >= 6:
                code_rates += [code.rate(k) for k in code_k[10:]]
                chat_rates += [chat.rate(k) for k in chat_k[10:]]
    chat_rate = sum(chat_rates) / len(chat_rates)
    assert sum(code_rates) / len(code_rates) > 1.35 * code.rate(0)
    if own_times:
        assert chat_rate >= 0.98 * chat.rate(0)
    else:
        assert chat_rate < 0.98 * chat.rate(0)


@dataclass
class PredraftedOnlyWorkload(Workload):
    """Pre-drafted only (orchestrator.drafting.model): at setting k ≥ 1 an iteration drafts only when the
    look-ahead before it came true — after a drafted iteration that accepted all k drafts and whose
    bonus token was guessed (rate `guess`), or after a step whose token was guessed (`step_guess`);
    else it is a target-only step. Either waits for the longer of the verifier's pass and the
    drafter's look-ahead, (k + 1) passes of t_q."""

    guess: float = 0.8
    step_guess: float = 0.8

    def look_ahead(self, k: int) -> float:
        return (k + 1) * self.t_q if k else 0.0

    def drafted_wall(self, k: int) -> float:
        return max(self.target(k + 1), self.look_ahead(k)) + self.overhead

    def step_wall(self, k: int) -> float:
        return max(self.target(1), self.look_ahead(k)) + self.overhead

    def drafted_share(self, k: int) -> float:
        """The stationary share h of drafted iterations: h = h·αᵏ·guess + (1 − h)·step_guess."""
        if k == 0:
            return 0.0
        stay = self.alpha**k * self.guess
        return self.step_guess / (1.0 - stay + self.step_guess)

    def rate(self, k: int) -> float:
        h = self.drafted_share(k)
        tokens = h * expected_tokens_per_iteration(self.alpha, k) + (1.0 - h)
        return tokens / (h * self.drafted_wall(k) + (1.0 - h) * self.step_wall(k))

    def run_request(self, request: DraftLength, iterations: int, rng: random.Random, *,
                    by_setting: bool = True) -> list[int]:
        chosen, predrafted = [], None
        for _ in range(iterations):
            k = request.choose()
            drafted = k if k and predrafted == k else 0
            accepted = self.accepted(drafted, rng)
            wall = self.drafted_wall(k) if drafted else self.step_wall(k)
            came_true = rng.random() < (self.guess if drafted else self.step_guess)
            predrafted = k if k and accepted == drafted and came_true else None
            observation = Observation(
                drafted=drafted,
                accepted=accepted,
                wall_seconds=wall * (1.0 + self.noise * (2.0 * rng.random() - 1.0)),
                verify_seconds=self.target(drafted + 1),
                draft_seconds=self.look_ahead(k),
                setting=k if by_setting else None,
                switched=request.switched,
            )
            request.pair.observe(observation)
            request.observe(observation)
            chosen.append(k)
        return chosen


@pytest.mark.parametrize(
    "alpha, t_q, best",
    [
        (0.85, 0.05, 1),  # code-like on a CPU: a 2-pass look-ahead about fits in the verifier's pass
        (0.95, 0.02, 5),  # a fast, accurate drafter: longer pre-drafts still fit
        (0.5, 0.07, 0),  # chat-like, slow drafter: waiting for the look-ahead loses
    ],
)
def test_predrafted_only_settles_on_its_optimum(alpha: float, t_q: float, best: int) -> None:
    """Iterations at k that only sometimes draft: E[tokens | k] counts the drafted share h(k), and
    W(k) their mixture with the steps at k, so the controller lands on the analytic optimum."""
    work = PredraftedOnlyWorkload(alpha=alpha, t_q=t_q)
    assert work.optimum(8) == best
    chosen = work.run_request(DraftLength(PairEstimates(), k_max=8, start_k=2), 600, random.Random(5))
    assert work.rate(settled(chosen)) >= 0.95 * work.rate(best), chosen[-100:]  # SWITCH_GAIN, noise


def test_predrafted_only_steps_are_not_target_only_samples() -> None:
    """Negative case: the steps of a pre-drafted-only request filed as k = 0 samples (no `setting`)
    make target-only look as slow as the look-ahead they waited for, and hide the iterations at k
    that did not draft: the controller then drafts where target-only is faster."""
    work = PredraftedOnlyWorkload(alpha=0.5, t_q=0.07)
    assert work.rate(1) < 0.9 * work.rate(0)
    for by_setting, expect_target_only in ((True, True), (False, False)):
        chosen = work.run_request(DraftLength(PairEstimates(), k_max=8, start_k=2), 400, random.Random(6),
                                  by_setting=by_setting)
        tail = chosen[-100:]
        assert (tail.count(0) >= 80) == expect_target_only, tail


def test_a_new_request_starts_where_the_pair_points() -> None:
    pair = PairEstimates()
    work = Workload(alpha=0.9, t_q=0.01)
    work.run(DraftLength(pair, k_max=8, start_k=2), 300, random.Random(7))
    assert DraftLength(pair, k_max=8, start_k=2).choose() >= 5


def test_rejects_a_bad_k_max() -> None:
    with pytest.raises(ValueError, match="k_max"):
        DraftLength(PairEstimates(), k_max=0, start_k=0)


# ------------------------------------------------------------------------------------------------
# through the loop: real tiny engines, one of them slowed down by a sleep per forward pass


def _orchestrator(model_dirs, draft: str, draft_sleep: float, target_sleep: float,
                  clock: VirtualClock | None = None, **config):
    from orchestrator.clients.inprocess import InProcessDrafterClient, InProcessVerifierClient
    from orchestrator.config import OrchestratorConfig
    from orchestrator.speculation import Orchestrator
    from specdec.engine.drafter import DrafterEngine
    from specdec.engine.verifier import VerifierEngine

    drafter = DrafterEngine(slowed_model(model_dirs[draft], draft_sleep, clock))
    verifier = VerifierEngine(slowed_model(model_dirs["target"], target_sleep, clock))
    return Orchestrator(
        InProcessDrafterClient(drafter),
        InProcessVerifierClient(verifier),
        OrchestratorConfig(**{"pipeline": False, **config}),
    )


def _request(n: int, prompt: list[int] | None = None, **fields):
    from specdec.generation import GenerationRequest

    return GenerationRequest(prompt_ids=prompt or [1, 2, 3], max_new_tokens=n, stop_token_ids=[], **fields)


async def test_a_slow_drafter_turns_requests_target_only(model_dirs) -> None:
    orch = _orchestrator(model_dirs, "draft", draft_sleep=0.06, target_sleep=0.01, adaptive_probe_every=16)
    result = await orch.generate(_request(48))
    methods = [r.method for r in result.iterations]
    assert methods[:4] == ["token"] * 4  # default_k until the first decision
    later = methods[12:]
    assert later and later.count("autoregressive") >= 0.8 * len(later), methods
    assert len(result.token_ids) == 48
    # A seeded request, or one naming k, keeps its k: replay must not depend on timings.
    seeded = await orch.generate(_request(12, seed=3))
    assert all(r.method == "token" and r.k == 2 for r in seeded.iterations)
    fixed = await orch.generate(_request(12, k=3))
    assert all(r.method == "token" and r.k == 3 for r in fixed.iterations)


async def test_an_exact_drafter_gets_longer_drafts(model_dirs, monkeypatch) -> None:
    """The drafter is the target's own weights (every draft accepted) and costs nothing next to a
    slow target: the longest allowed draft wins. Timed on a virtual clock: with real sleeps a busy
    host's cost of the tiny passes sometimes outweighed the target's 30 ms."""
    clock = VirtualClock()
    monkeypatch.setattr(time, "perf_counter", clock)
    orch = _orchestrator(model_dirs, "target", draft_sleep=0.0, target_sleep=0.03, clock=clock, max_k=6)
    result = await orch.generate(_request(100))
    ks = [r.k for r in result.iterations]
    assert ks[:4] == [2] * 4 and ks[-1] == 6, ks


async def test_only_the_prompt_iteration_is_unsteady(model_dirs, monkeypatch) -> None:
    """Through the loop: the first iteration (both engines take in the 40-token prompt) teaches
    acceptance but no time; every later one, pre-drafted or drafted afresh, is a timing sample."""
    seen: list[Observation] = []
    original = PairEstimates.observe
    monkeypatch.setattr(PairEstimates, "observe", lambda self, obs: (seen.append(obs), original(self, obs)))
    orch = _orchestrator(model_dirs, "draft", draft_sleep=0.0, target_sleep=0.0)
    result = await orch.generate(_request(12, prompt=[1 + i % 5 for i in range(40)], k=2))
    assert len(seen) == len(result.iterations) > 2
    assert [obs.steady for obs in seen] == [False] + [True] * (len(seen) - 1)


@pytest.mark.parametrize("predrafted_only", [True, False])
async def test_pipelined_requests_verify_only_pre_drafts(model_dirs, predrafted_only: bool) -> None:
    """Pre-drafted only, through the loop: every drafted iteration verifies a look-ahead's block, and
    an iteration without one is a target-only step (not a fallback) while the drafter looks ahead —
    the first iteration among them, so the drafter takes in the prompt beside the verifier. Without
    it (the negative case) the first iteration and every one after a miss draft afresh."""
    orch = _orchestrator(model_dirs, "target", draft_sleep=0.0, target_sleep=0.01, pipeline=True,
                         predrafted_only=predrafted_only)
    result = await orch.generate(_request(40))
    assert len(result.token_ids) == 40
    drafted = [r for r in result.iterations if r.drafted]
    steps = [r for r in result.iterations if not r.drafted]
    assert drafted and not any(r.fallback for r in result.iterations)
    if predrafted_only:
        assert result.stats.pre_drafts_used == len(drafted)
        assert steps and not result.iterations[0].drafted
    else:
        assert result.stats.pre_drafts_used < len(drafted) and result.iterations[0].drafted


@dataclass
class SharedCoresWorkload(PredraftedOnlyWorkload):
    """Pre-drafted only where the drafter shares the verifier's cores (`up` on one CPU): beside a
    look-ahead the verifier's pass runs at half speed, so a step beside the look-ahead costs twice a
    step alone (2 vCPUs: 150–230 against 72–80 ms)."""

    def drafted_wall(self, k: int) -> float:
        return max(2.0 * self.target(k + 1), self.look_ahead(k)) + self.overhead

    def step_wall(self, k: int) -> float:
        if k == 0:
            return self.target(1) + self.overhead
        return max(2.0 * self.target(1), self.look_ahead(k)) + self.overhead

    def verify_seconds(self, k: int, drafted: int) -> float:
        return (2.0 if k else 1.0) * self.target(drafted + 1)


@pytest.mark.parametrize("alone_measured", [True, False])
def test_target_only_is_judged_by_steps_alone_not_by_steps_beside_the_look_ahead(
        alone_measured: bool) -> None:
    """A pair that has run pre-drafted only at k = 2 (drafted iterations and steps beside the
    look-ahead, at half speed) and never k = 0: its 1-position verifier calls are those steps, so
    read as W(0) they make target-only look as slow as drafting and a request drafts on although
    steps alone are faster (the negative case). With the hybrid's measure of steps alone
    (SourceEstimates, W(1)) the pair's W(0) is a step alone and the request's best is target-only."""
    work = SharedCoresWorkload(alpha=0.6, t_p=0.07, t_q=0.03, guess=0.5, step_guess=0.5)
    assert work.rate(2) < 0.8 * work.rate(0)  # drafting loses here
    alone = SourceEstimates()
    if alone_measured:
        for rows in (1, 2, 3):
            for _ in range(4):
                alone.observe(None, predicted=0.0, accepted=0, positions=rows,
                              wall_seconds=work.target(rows) + work.overhead)
    pair = PairEstimates(alone=alone)
    rng, predrafted = random.Random(8), None
    for _ in range(200):  # the pair's history: requests at k = 2
        drafted = 2 if predrafted == 2 else 0
        accepted = work.accepted(drafted, rng)
        wall = work.drafted_wall(2) if drafted else work.step_wall(2)
        came_true = rng.random() < (work.guess if drafted else work.step_guess)
        predrafted = 2 if accepted == drafted and came_true else None
        pair.observe(Observation(drafted=drafted, accepted=accepted, wall_seconds=wall,
                                 verify_seconds=work.verify_seconds(2, drafted),
                                 draft_seconds=work.look_ahead(2), setting=2))
    w0 = pair.iteration_seconds(0)
    if alone_measured:
        assert w0 == pytest.approx(work.step_wall(0), rel=0.01)
    else:
        assert w0 == pytest.approx(2.0 * work.target(1), rel=0.01)  # a step beside the look-ahead
    assert (DraftLength(pair, k_max=4, start_k=2).best() == 0) == alone_measured


def _pair_with(w0: float, walls: dict[int, float], samples: int = 4) -> PairEstimates:
    """A pair whose target-only steps alone take w0 and whose iterations at k take walls[k]."""
    alone = SourceEstimates()
    for _ in range(samples):
        alone.observe(None, predicted=0.0, accepted=0, positions=1, wall_seconds=w0)
    pair = PairEstimates(alone=alone)
    for k, wall in walls.items():
        for _ in range(samples):
            pair.observe(Observation(drafted=k, accepted=k, wall_seconds=wall, verify_seconds=0.8 * wall,
                                     draft_seconds=0.3 * wall, setting=k))
    return pair


def test_a_model_that_cannot_pay_even_at_full_acceptance_gets_no_opening() -> None:
    """Iterations at k = 2 cost 0.4 s where a step alone costs 0.11 s (a drafter on the verifier's
    cores): three tokens an iteration could not pay, so a new request drafts not even its opening,
    and an unmeasured length's model (fitted to times alone and beside) does not tempt it either."""
    pair = _pair_with(0.11, {2: 0.4})
    assert pair.measured_lengths() == [2] and pair.cannot_pay()
    chooser = DraftLength(pair, k_max=4, start_k=2, opening=4)
    assert [chooser.choose() for _ in range(8)] == [0] * 8
    assert chooser.best() == 0


def test_a_model_that_could_pay_keeps_its_opening() -> None:
    """The same pair with iterations at k = 2 costing 0.2 s (under three steps): the opening stays,
    and so does the choice by estimated rate; a length that ran too few times is not a measurement."""
    pair = _pair_with(0.11, {2: 0.2})
    assert not pair.cannot_pay()
    chooser = DraftLength(pair, k_max=4, start_k=2, opening=4)
    assert all(k > 0 for k in [chooser.choose() for _ in range(4)])
    assert not _pair_with(0.11, {2: 0.4}, samples=1).cannot_pay()
    assert not _pair_with(0.11, {}).cannot_pay()
