"""Online choice of the draft length, down to target-only (docs/algorithms.md §8, "Online draft
length").

Two pieces. `PairEstimates`, one per model pair (model ids carry the precision) and method, shared
by every request, learns from the iterations the orchestrator already runs, with exponentially
decaying weights (half-life HALF_LIFE iterations), so it follows a workload that changes:

  α_d     acceptance at draft depth d given depth d was reached (shrunk towards the pooled α),
  W(k)    the measured wall time of an iteration at draft length k (k = 0: target-only; until the
          pair runs k = 0 itself, a target-only step alone as the hybrid measures it),
  h(k)    the share of iterations at k that drafted (pre-drafted only: the others were steps),
  T_p(n)  the verifier call's time for n positions (a line through the measured sizes),
  T_q     the drafter's time per drafted token,
  O       the rest of a speculative iteration (orchestration, transport, waits; below zero when
          pipelining hides the drafter).

`DraftLength`, one per request, keeps the request's own acceptance (code and prose differ a lot)
and its own iteration times (pipelined, an iteration is cheap when the look-ahead before it came
true, so W(k) falls with acceptance; the pair's mean, mostly code, flatters chat), and picks
k ∈ {0, …, k_max} maximising tokens per second, E[tokens | k] / W(k), with

  E[tokens | k] = 1 + h(k)·Σ_{i=1..k} Π_{d=1..i} α_d   (§7 with per-depth α: the pair's profile α_d
                                                    scaled to the request's own pooled rate; h(k)
                                                    the share of iterations at k that drafted: 1
                                                    with fresh drafts, below with pre-drafted only,
                                                    where an iteration without a pre-draft is a
                                                    target-only step beside a look-ahead)
  W(k)          = the request's own mean at k with REQUEST_WALL_PRIOR pseudo-samples of the pair's:
                  measured W(k) where k ran recently (weight ≥ MIN_WEIGHT), else
                  k·T_q + T_p(k + 1) + O            (§7's timed denominator plus the overhead)

so the model is exact at the lengths that ran and only extrapolates to the others. k is the
request's setting (Observation.setting): W(k) and h(k) count every iteration at it, drafted or
not. Iterations that begin with a prefill (a prompt, a drafter's catch-up) teach acceptance but
not times. A request opens with `opening` iterations (OPENING, PREDRAFTED_OPENING) at the pair's
best non-zero k (its own acceptance shows only while it drafts) and then decides every
DECIDE_EVERY iterations; not when the model cannot pay at any measured length even if every
draft were accepted (PairEstimates.cannot_pay): then there is no opening. At k = 0 a
speculative probe, once the pair ran `probe_every` iterations without drafting, notices when
speculation pays again; while drafting, every `explore_every` iterations one iteration at a
neighbour whose measurement faded keeps W honest.

Any k is exact (docs/algorithms.md §8): k is fixed before the iteration drafts, from finished
iterations only. The choice depends on timings, so seeded requests (which ask for replay) and
requests that name k keep a fixed k (orchestrator.run).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

HALF_LIFE = 64.0  # iterations of the pair
MIN_WEIGHT = 2.0  # decayed samples before a measured W(k) replaces the model
DEPTH_PRIOR = 16.0  # pseudo-samples pulling a depth's α towards the pair's pooled α
REQUEST_PRIOR = 4.0  # pseudo-samples pulling a request's pooled α towards the pair's
SHARE_PRIOR = 4.0  # pseudo-samples pulling a length's drafted share towards the pair's pooled share
REQUEST_WALL_PRIOR = 2.0  # pseudo-samples pulling a request's own W(k) towards the pair's
PRIOR_ALPHA = 0.6  # before any acceptance was seen
PRIOR_SLOPE = 0.075  # T_p(n) ≈ T_p(1)·(1 + 0.075·(n − 1)) until two sizes were measured (int8 CPU)
DECIDE_EVERY = 4  # a request's iterations between decisions (a pre-draft of the old length is dropped)
OPENING = 2  # a request's first iterations at the pair's best k ≥ 1, whatever the pair says
# Pre-drafted only (orchestrator.drafting.model): an opening iteration that finds no pre-draft is a target
# step beside a look-ahead, not a fresh draft, so a longer opening costs little and lets a request
# whose acceptance differs from the pair's (code beside chat) show it.
PREDRAFTED_OPENING = 4
SWITCH_GAIN = 1.03  # a new k must promise 3 % more tokens/s than the current one


@dataclass
class _Mean:
    """A decaying mean Σ wᵢxᵢ / Σ wᵢ: `fade` multiplies the old weights by the decay, `add` gives
    a new sample weight 1."""

    total: float = 0.0
    weight: float = 0.0

    def add(self, value: float, weight: float = 1.0) -> None:
        self.total += weight * value
        self.weight += weight

    def fade(self, decay: float) -> None:
        self.total *= decay
        self.weight *= decay

    @property
    def value(self) -> float:
        return self.total / self.weight if self.weight > 0 else math.nan


@dataclass(frozen=True)
class Observation:
    """What the estimates read from one finished iteration."""

    drafted: int  # tokens drafted (0: a target-only step)
    accepted: int  # drafts accepted
    wall_seconds: float  # the whole iteration
    verify_seconds: float  # its verifier calls
    draft_seconds: float  # its drafter calls (those of a pre-draft ran in the iteration before)
    # False when an engine first took in more than STEADY_CATCH_UP committed tokens (a request's
    # prompt, the drafter's catch-up on a probe after target-only steps): its acceptance counts, its
    # times do not — every request's first iteration would otherwise charge both prompts' prefill to
    # W(k ≥ 1), and never to W(0), and bias the choice against drafting.
    steady: bool = True
    # The draft length the request chose (None: `drafted`). It differs from `drafted` when a
    # pre-drafted-only request had no pre-draft for its prefix and took a target-only step while the
    # drafter looked ahead (orchestrator.drafting.model): that step's time and yield belong to setting k.
    setting: int | None = None
    # The request's setting changed at this iteration: a pre-draft of the old length does not fit,
    # so at a new setting the first iteration never drafts; it says nothing of the drafted share.
    switched: bool = False

    @property
    def chosen(self) -> int:
        return self.drafted if self.setting is None else self.setting


def _count_depths(hits: list[_Mean], obs: Observation) -> None:
    """One trial per depth the path reached (it stops at the first miss), a hit where it went on."""
    while len(hits) < obs.drafted:
        hits.append(_Mean())
    for d in range(min(obs.accepted + 1, obs.drafted)):
        hits[d].add(1.0 if d < obs.accepted else 0.0)


def _count_share(drafted: dict[int, _Mean], obs: Observation) -> None:
    """One trial of the drafted share at the chosen length ≥ 1, unless the length just changed."""
    if obs.chosen > 0 and not obs.switched:
        drafted.setdefault(obs.chosen, _Mean()).add(1.0 if obs.drafted > 0 else 0.0)


def _pooled(hits: list[_Mean], prior: float, prior_weight: float) -> float:
    """The rate over every depth, with `prior_weight` pseudo-samples of `prior`."""
    total = sum(m.total for m in hits)
    weight = sum(m.weight for m in hits)
    return (total + prior_weight * prior) / (weight + prior_weight)


def _line_seconds(by_size: dict[int, _Mean], n: float) -> float:
    """A weighted least-squares line through the mean seconds measured at each size, read at n
    (PRIOR_SLOPE through a single size; nan with none)."""
    points = [(size, m.value, m.weight) for size, m in by_size.items() if m.weight > 0]
    if not points:
        return math.nan
    if len({size for size, _, _ in points}) == 1:
        size, t, _ = points[0]
        return t / (1.0 + PRIOR_SLOPE * (size - 1)) * (1.0 + PRIOR_SLOPE * (n - 1))
    w = sum(p[2] for p in points)
    mx = sum(s * wt for s, _, wt in points) / w
    my = sum(t * wt for _, t, wt in points) / w
    sxx = sum(wt * (s - mx) ** 2 for s, _, wt in points)
    slope = max(0.0, sum(wt * (s - mx) * (t - my) for s, t, wt in points) / sxx)
    return max(1e-9, my + slope * (n - mx))


@dataclass
class PairEstimates:
    """Acceptance and timings of one model pair and method, over every request (module docstring)."""

    half_life: float = HALF_LIFE
    # Where the orchestrator measures target-only steps with nothing beside them (the hybrid's
    # SourceEstimates): W(0) until this pair has run k = 0 itself (iteration_seconds).
    alone: SourceEstimates | None = field(default=None, repr=False, compare=False)
    _hits: list[_Mean] = field(default_factory=list)  # per depth: accepted (1) or not (0)
    _wall: dict[int, _Mean] = field(default_factory=dict)  # per chosen length (Observation.chosen)
    _drafted: dict[int, _Mean] = field(default_factory=dict)  # per chosen length ≥ 1: drafted (1) or not
    _verify: dict[int, _Mean] = field(default_factory=dict)  # per verified positions n = k + 1
    _draft_per_token: _Mean = field(default_factory=_Mean)
    _overhead: _Mean = field(default_factory=_Mean)
    since_speculative: int = 0  # the pair's iterations since one drafted (the probes' clock)

    @property
    def decay(self) -> float:
        return 0.5 ** (1.0 / self.half_life)

    def observe(self, obs: Observation) -> None:
        """Fold in one iteration. Every estimate fades at each of the pair's iterations (not only
        at those that update it), so a rarely measured quantity — T_q while the pair runs
        target-only — is carried by its fresh samples once they come."""
        k, chosen = obs.drafted, obs.chosen
        self.since_speculative = 0 if chosen > 0 else self.since_speculative + 1
        decay = self.decay
        for mean in (
            *self._hits,
            *self._wall.values(),
            *self._drafted.values(),
            *self._verify.values(),
            self._draft_per_token,
            self._overhead,
        ):
            mean.fade(decay)
        if k > 0:
            _count_depths(self._hits, obs)
        _count_share(self._drafted, obs)
        if not obs.steady:
            return
        self._wall.setdefault(chosen, _Mean()).add(obs.wall_seconds)
        if obs.verify_seconds > 0:
            self._verify.setdefault(k + 1, _Mean()).add(obs.verify_seconds)
        if k == 0 or k != chosen:
            return
        if obs.draft_seconds > 0:
            self._draft_per_token.add(obs.draft_seconds / k)
        model = self._model_seconds(k, overhead=0.0)
        if math.isfinite(model):
            self._overhead.add(obs.wall_seconds - model)

    def pooled_alpha(self) -> float:
        return _pooled(self._hits, PRIOR_ALPHA, 1e-9 if self._hits else 1.0)

    def forget_acceptance(self) -> None:
        """Keep the timings, drop what the drafts' acceptance taught (a start-up warm-up's prompt is
        not the users' workload: its acceptance must not steer their first requests)."""
        self._hits.clear()
        self._drafted.clear()

    def drafted_share(self, k: int) -> float:
        """The share of iterations at chosen length k that drafted (1 when every one drafts: fresh
        drafts; below when only pre-drafts are verified), with SHARE_PRIOR pseudo-samples of the
        share pooled over every length (itself with SHARE_PRIOR of PRIOR_ALPHA: one miss in a
        request's first iterations must not read as "never drafts")."""
        pooled = _pooled(list(self._drafted.values()), PRIOR_ALPHA, SHARE_PRIOR)
        return _pooled([self._drafted.get(k, _Mean())], pooled, SHARE_PRIOR)

    def alphas(self, k: int) -> list[float]:
        """α_1..α_k: each depth's rate with DEPTH_PRIOR pseudo-samples of the pooled rate, so depths
        seldom reached read as the pooled rate."""
        pooled = self.pooled_alpha()
        out = []
        for d in range(k):
            mean = self._hits[d] if d < len(self._hits) else _Mean()
            out.append((mean.total + DEPTH_PRIOR * pooled) / (mean.weight + DEPTH_PRIOR))
        return out

    def target_seconds(self, n: int) -> float:
        """T_p(n): a weighted least-squares line through the measured sizes (PRIOR_SLOPE through one)."""
        return _line_seconds(self._verify, n)

    def _model_seconds(self, k: int, overhead: float) -> float:
        t_q = self._draft_per_token.value if self._draft_per_token.weight > 0 else 0.0
        return k * t_q + self.target_seconds(k + 1) + overhead

    def weight(self, k: int) -> float:
        wall = self._wall.get(k)
        return wall.weight if wall is not None else 0.0

    def measured_lengths(self) -> list[int]:
        """The draft lengths k ≥ 1 whose W(k) is measured (weight ≥ MIN_WEIGHT), not modelled."""
        return sorted(k for k, wall in self._wall.items() if k >= 1 and wall.weight >= MIN_WEIGHT)

    def cannot_pay(self) -> bool:
        """Whether the draft model cannot beat a target-only step even if every draft were accepted:
        some length ran, and at every measured k ≥ 1 the ceiling (1 + k) / W(k) is at most 1 / W(0).

        This is what a drafter on the verifier's own cores measures: its look-ahead and the verifier's
        pass slow each other, so an iteration beside one costs 3-4 target-only steps (2-vCPU AMX
        Xeon: 300-460 against 105-120 ms; bench/RESULTS.md, "The draft model that cannot pay"). A
        request's opening then only loses, and the timed model of an unmeasured length, fitted to
        the verifier's passes alone and beside the drafter, is no guide (it made k = 1 look cheap)."""
        step = self.iteration_seconds(0)
        measured = self.measured_lengths()
        if not measured or not math.isfinite(step) or step <= 0:
            return False
        return all(self._wall[k].value >= (1 + k) * step for k in measured)

    def iteration_seconds(self, k: int) -> float:
        """W(k): measured where k ran recently enough, else the timed model (nan: nothing to go on).

        W(0) unmeasured is a target-only step alone, as `alone` measured it, before T_p(1): the
        pair's 1-position verifier calls are mostly the steps a pre-drafted-only request takes
        beside its drafter's look-ahead, and where the drafter shares the verifier's cores those
        run at half speed (2 vCPUs: 150–195 against 101–117 ms, bench/RESULTS.md "Issue 37's last
        items"), so T_p(1) made target-only look as slow as the look-ahead and the model drafted
        where steps alone were faster."""
        if self.weight(k) >= MIN_WEIGHT:
            return self._wall[k].value
        if k == 0:
            alone = self.alone.iteration_seconds(1) if self.alone is not None else math.nan
            return alone if math.isfinite(alone) else self.target_seconds(1)
        overhead = self._overhead.value if self._overhead.weight > 0 else 0.0
        return self._model_seconds(k, overhead)


@dataclass
class DraftLength:
    """One request's draft length: its own acceptance, the pair's timings (module docstring)."""

    pair: PairEstimates
    k_max: int
    start_k: int
    probe_every: int = 64
    explore_every: int = 32
    opening: int = OPENING  # first iterations drafted whatever the pair says: the request's own acceptance
    wall_prior: float = REQUEST_WALL_PRIOR  # pseudo-samples of the pair's W(k) in the request's own
    _hits: list[_Mean] = field(default_factory=list)
    _wall: dict[int, _Mean] = field(default_factory=dict)  # the request's own steady W(k) samples
    _drafted: dict[int, _Mean] = field(default_factory=dict)  # its own drafted shares per chosen k
    _current: int = 0
    _last_choice: int | None = None
    switched: bool = False  # the last choose() returned another length than the one before (or none)
    _since_decision: int = 0
    _since_explore: int = 0

    def __post_init__(self) -> None:
        if self.k_max < 1:
            raise ValueError(f"k_max must be >= 1, got {self.k_max}")
        self._current = max(0, min(self.start_k, self.k_max))
        if self.pair.cannot_pay():
            # No acceptance could make the model pay at the measured times: no opening; decide at once.
            self._current = 0
            self._since_decision = DECIDE_EVERY
        elif any(math.isfinite(self.tokens_per_second(k)) for k in range(self.k_max + 1)):
            # The pair has history: open at its best draft length (never 0: a request's own acceptance
            # is only seen while it drafts — code may pay where the pair's prose did not), then
            # decide after `opening` iterations.
            self._current = max(range(1, self.k_max + 1), key=self._rate_or_zero)
            self._since_decision = DECIDE_EVERY - self.opening

    def observe(self, obs: Observation) -> None:
        """Count the request's own iteration (the pair's estimates are fed separately)."""
        self._since_decision += 1
        self._since_explore += 1
        if obs.drafted > 0:
            _count_depths(self._hits, obs)
        _count_share(self._drafted, obs)
        if obs.steady:
            self._wall.setdefault(obs.chosen, _Mean()).add(obs.wall_seconds)

    def alphas(self, k: int) -> list[float]:
        """The pair's per-depth profile α_d, scaled to this request's own pooled rate (itself with
        REQUEST_PRIOR pseudo-samples of the pair's): code and prose differ mostly in level."""
        pair_pooled = self.pair.pooled_alpha()
        own = _pooled(self._hits, pair_pooled, REQUEST_PRIOR)
        scale = own / pair_pooled if pair_pooled > 0 else 1.0
        return [min(1.0, a * scale) for a in self.pair.alphas(k)]

    def drafted_share(self, k: int) -> float:
        """h(k): the share of this request's iterations at k that drafted, with REQUEST_PRIOR
        pseudo-samples of the pair's (pre-drafted only, the others are target-only steps)."""
        return _pooled([self._drafted.get(k, _Mean())], self.pair.drafted_share(k), REQUEST_PRIOR)

    def expected_tokens(self, k: int) -> float:
        """E[tokens | k] = 1 + h(k)·Σ_{i≤k} Π_{d≤i} α_d (h = 1 when every iteration drafts)."""
        if k == 0:
            return 1.0
        drafted, reach = 0.0, 1.0
        for alpha in self.alphas(k):
            reach *= alpha
            drafted += reach
        return 1.0 + self.drafted_share(k) * drafted

    def iteration_seconds(self, k: int) -> float:
        """This request's W(k): its own steady iterations at k, with `wall_prior` pseudo-samples of the
        pair's W(k). Pipelined, an iteration is cheap when the look-ahead before it came true (every
        draft accepted, the bonus guessed), so W(k) falls with the request's own acceptance: a chat
        request beside code pays more per iteration than the pair's mean says."""
        pair = self.pair.iteration_seconds(k)
        own = self._wall.get(k)
        if own is None or own.weight == 0:
            return pair
        if not math.isfinite(pair):
            return own.value
        return (own.total + self.wall_prior * pair) / (own.weight + self.wall_prior)

    def tokens_per_second(self, k: int) -> float:
        seconds = self.iteration_seconds(k)
        return self.expected_tokens(k) / seconds if seconds > 0 else math.nan

    def _rate_or_zero(self, k: int) -> float:
        rate = self.tokens_per_second(k)
        return rate if math.isfinite(rate) else 0.0

    def best(self) -> int:
        """The k with the most tokens/s by the current estimates (the current k while unknown). Where
        the model cannot pay at the lengths measured (PairEstimates.cannot_pay), only those and k = 0
        are candidates: an unmeasured length's timed model is then no guide."""
        lengths = range(self.k_max + 1)
        if self.pair.cannot_pay():
            lengths = [0, *(k for k in self.pair.measured_lengths() if k <= self.k_max)]
        rates = {k: self.tokens_per_second(k) for k in lengths}
        known = {k: r for k, r in rates.items() if math.isfinite(r)}
        if not known:
            return self._current
        return max(known, key=lambda k: (known[k], -k))

    def choose(self) -> int:
        """The draft length of the next iteration (0: a target-only step); see `_choose`."""
        k = self._choose()
        self.switched = k != self._last_choice  # a request's first iteration has no pre-draft either
        self._last_choice = k
        return k

    def _choose(self) -> int:
        """The draft length of the next iteration (0: a target-only step).

        Mostly the current choice, re-decided every DECIDE_EVERY iterations. Two exceptions keep
        the estimates honest: at k = 0, a speculative probe once the pair (all its requests) ran
        `probe_every` iterations without drafting — a probe costs the drafter's catch-up over the
        context it skipped, so it is rare; and while drafting, every `explore_every` iterations, one
        iteration at a neighbour (k ± 1, or 0) whose own measurement has faded, so the model never
        rests on extrapolation alone.
        """
        current = self._current
        if current == 0:
            if self.pair.since_speculative >= self.probe_every:
                return max(range(1, self.k_max + 1), key=self._rate_or_zero)
        elif self._since_explore >= self.explore_every:
            neighbours = {0, current - 1, current + 1} - {current}
            stale = [k for k in neighbours if 0 <= k <= self.k_max and self.pair.weight(k) < MIN_WEIGHT]
            if stale:
                self._since_explore = 0
                return min(stale, key=lambda k: (self.pair.weight(k), k))
        if self._since_decision >= DECIDE_EVERY:
            self._since_decision = 0
            best = self.best()
            current_rate = self.tokens_per_second(current)
            if not math.isfinite(current_rate) or self.tokens_per_second(best) > SWITCH_GAIN * current_rate:
                self._current = best
        return self._current


# ------------------------------------------------------------------------------------------------
# the expected time of a drafter call (its deadline: failover.drafter_deadline)

STEADY_CATCH_UP = 16  # calls with at most this many new committed tokens teach the time per pass
CATCH_UP_PER_PASS = 8  # a catch-up (prefill) of this many tokens is assumed to cost one pass
CUT_OFF_WEIGHT = 0.25  # a call cut off at its deadline counts as this much of a sample of it


@dataclass
class DrafterCallTimes:
    """How long a drafter call should take: seconds per forward pass, a decaying mean over the
    drafter's calls without a long catch-up (all runs share it), the verifier's while the drafter has
    none yet (the drafter is the smaller model), and `unknown_pass_s` before either was measured.

    A call of `passes` passes that first takes in `catch_up` committed tokens is expected to take
    t_pass · (passes + catch_up / CATCH_UP_PER_PASS): a prefill costs far less per token than a
    decode pass, so this errs on the generous side. A call cut off at its deadline counts as a
    light sample (CUT_OFF_WEIGHT) of its deadline, so a drafter that became slower for everyone
    slowly raises the expectation instead of being abandoned forever, while one stuck call moves
    it little.
    """

    half_life: float = HALF_LIFE
    _drafter: _Mean = field(default_factory=_Mean)
    _verifier: _Mean = field(default_factory=_Mean)

    def observe(self, passes: int, catch_up: int, seconds: float, *, cut_off: bool = False) -> None:
        """One drafter call that took `seconds` (cut_off: abandoned after them)."""
        self._fold(self._drafter, passes, catch_up, seconds, CUT_OFF_WEIGHT if cut_off else 1.0)

    def observe_verifier(self, passes: int, catch_up: int, seconds: float) -> None:
        self._fold(self._verifier, passes, catch_up, seconds, 1.0)

    def _fold(self, mean: _Mean, passes: int, catch_up: int, seconds: float, weight: float) -> None:
        if catch_up > STEADY_CATCH_UP or passes < 1 or not math.isfinite(seconds) or seconds < 0:
            return
        mean.fade(0.5 ** (1.0 / self.half_life))
        mean.add(seconds / passes, weight)

    def pass_seconds(self, unknown_pass_s: float) -> float:
        for mean in (self._drafter, self._verifier):
            if mean.weight > 0:
                return mean.value
        return unknown_pass_s

    def expected(self, passes: int, catch_up: int, unknown_pass_s: float) -> float:
        """Expected seconds of a drafter call of `passes` forward passes after `catch_up` new tokens."""
        return self.pass_seconds(unknown_pass_s) * (max(1, passes) + max(0, catch_up) / CATCH_UP_PER_PASS)


# ------------------------------------------------------------------------------------------------
# whether a request should take the draft model back after model-free turns (drafting.hybrid)

MODEL_SHARE_PRIOR = 16.0  # pseudo-tokens of the orchestrator's share in a request's share


def model_share(model_side_tokens: float, tokens: float, shared: float = math.nan,
                prior: float = MODEL_SHARE_PRIOR) -> float:
    """The share of a request's coming tokens expected where no model-free draft is chosen: its own
    share so far, with `prior` tokens' weight on the orchestrator's recent share (`shared`; 1 while
    unmeasured). A fresh request's prompt shows nothing yet: on a server of code edits, most of its
    tokens will come from model-free drafts; on one of chats, few."""
    start = shared if math.isfinite(shared) else 1.0
    return (model_side_tokens + prior * start) / (tokens + prior)


def drafter_catch_up_pays(*, remaining_tokens: int, share: float, step_seconds: float, model_rate: float,
                          catch_up_seconds: float) -> bool:
    """Whether the draft model should take in the tokens it has not seen (a request's prompt, the
    tokens of model-free turns) to draft again: the time its drafts are expected to save over the
    rest of the request (tokens on its side × (a target-only step's time − its time per token))
    exceeds the catch-up's time. A catch-up holds the iteration (the look-ahead waits for it) and,
    beside a prefill, slows the target's own pass: measured, a 335-token prompt's catch-up took about
    3.4 s and doubled the target's prefill (bench/RESULTS.md, "The draft model's catch-up").

    With the model's own rate unmeasured (a fresh server) it drafts, since that is how it gets
    measured, unless even a free model could not pay: its saving is at most a whole target-only step
    a token. On a fresh server's first code edit that bound refuses a catch-up of the prompt that
    cost 1.9 s, where model-free drafts had made most of the tokens (bench/RESULTS.md, "The first
    requests of a fresh server"). With the step or the catch-up unmeasured (nan) the model drafts."""
    if not all(math.isfinite(v) for v in (step_seconds, catch_up_seconds)):
        return True
    measured = math.isfinite(model_rate) and model_rate > 0
    saving_per_token = step_seconds - 1.0 / model_rate if measured else step_seconds
    return remaining_tokens * share * saving_per_token > catch_up_seconds


CALIBRATION_PRIOR = 4.0  # pseudo-tokens pulling a source's accepted ÷ predicted towards 1
# The prompt's pass comes once a request, so its drafts' record fades by prompt passes: faded by
# every iteration (64 a half-life) it forgot each request's miss before the next one came.
PROMPT_HALF_LIFE = 8.0
# Predicted tokens' worth of the orchestrator-wide c_s in one request's own estimate: after a few
# drafts the request's own record decides (prose beside grounded work must not borrow its c_s).
REQUEST_PRIOR = 4.0


# Each refused proposal multiplies a request's own record by this: a request that stopped drafting
# after early misses drifts back towards the shared c_s and tries again (one draft, then it knows),
# instead of staying target-only for good (measured: a rename that drafted 0 of its last 21 steps).
REQUEST_FORGET = 0.8

# A model-free draft's node cap follows the measured pass time: it may grow while a pass verifying the
# draft costs at most this many target-only steps, so a draft rejected whole costs at most one step
# more than the step it replaced, whatever the CPU (docs/algorithms.md §15, "How long a model-free draft").
DRAFT_COST_STEPS = 2.0


def request_calibration(shared: float, predicted: float, accepted: float,
                        prior: float = REQUEST_PRIOR) -> float:
    """c_s for one request: its own accepted ÷ predicted tokens, shrunk towards the shared c_s with
    `prior` predicted tokens' weight (the shared value alone before the request has drafted)."""
    return (accepted + prior * shared) / (predicted + prior)


def _calibration(predicted: _Mean | None, accepted: _Mean | None) -> float:
    """(accepted + CALIBRATION_PRIOR) ÷ (predicted + CALIBRATION_PRIOR), from decayed totals."""
    return (((accepted.total if accepted else 0.0) + CALIBRATION_PRIOR)
            / ((predicted.total if predicted else 0.0) + CALIBRATION_PRIOR))


@dataclass
class SourceEstimates:
    """What model-free drafts (orchestrator.drafting.model_free) have been worth, over every request of
    the orchestrator, for the hybrid's choice (orchestrator.drafting.hybrid):

      c_s     per source, accepted ÷ predicted tokens (the proposal's own estimate, Σ of its path
              probabilities), with CALIBRATION_PRIOR pseudo-tokens of 1: a proposal's counts say how
              often a continuation recurred, not how often the target agrees;
      W(r)    the wall time of an iteration without the draft model (a model-free draft, or a
              target-only step) whose verifier pass carried r query rows: a line through the measured
              sizes. Alone in its pass, r is the request's own positions; in a batched pass (many
              requests of a server), r counts every call's rows, padded to the widest
              (VerifyOutcome.pass_rows; specdec.runtime.batching);
      B       calls per verifier pass (pass_calls; 1 alone).

    A draft of n positions is charged W(B·n): the time of a pass in which every one of the B calls
    verifies as many positions. That is what a draft costs once requests share passes: the pass pads
    every call to the widest, so one request's long draft makes the whole batch's pass long, and every
    request of a busy server faces the same choice. Charged W(n) instead (its own rows only), each
    request saw its positions as nearly free beside the others' and drafted long, and on a CPU, where
    a pass costs in proportion to its rows, 8 clients filled the passes with rows that were thrown away
    (bench/RESULTS.md, "Serving: batch-aware drafts"). Alone (B = 1) the two agree.

    Decayed like PairEstimates (half-life HALF_LIFE iterations), so a changing workload is followed.
    """

    half_life: float = HALF_LIFE
    _predicted: dict[str, _Mean] = field(default_factory=dict)
    _accepted: dict[str, _Mean] = field(default_factory=dict)
    _wall: dict[int, _Mean] = field(default_factory=dict)
    _model_side: _Mean = field(default_factory=_Mean)  # per token: made without a model-free draft
    _calls: _Mean = field(default_factory=_Mean)  # calls per verifier pass (B)
    _prompt_predicted: dict[str, _Mean] = field(default_factory=dict)  # drafts on a prompt's pass
    _prompt_accepted: dict[str, _Mean] = field(default_factory=dict)

    def observe(self, source: str | None, *, predicted: float, accepted: int, positions: int,
                wall_seconds: float, steady: bool = True, pass_calls: float = 1.0,
                pass_rows: float | None = None) -> None:
        """One iteration without the draft model: a model-free draft of `source` (None: a target-only
        step) that verified `positions` positions, in a verifier pass of `pass_calls` calls and
        `pass_rows` rows (None: alone, its positions); its time only when steady (no prefill in it)."""
        decay = 0.5 ** (1.0 / self.half_life)
        for mean in (*self._predicted.values(), *self._accepted.values(), *self._wall.values(), self._calls):
            mean.fade(decay)
        if source is not None:
            self._predicted.setdefault(source, _Mean()).add(predicted)
            self._accepted.setdefault(source, _Mean()).add(float(accepted))
        if steady and wall_seconds > 0:
            rows = max(positions, round(pass_rows)) if pass_rows is not None else positions
            self._wall.setdefault(rows, _Mean()).add(wall_seconds)
            self._calls.add(max(1.0, pass_calls))

    def observe_prompt_draft(self, source: str, *, predicted: float, accepted: int) -> None:
        """A model-free draft of `source` on a pass that took in a prompt: a record of its own, faded
        by such passes (PROMPT_HALF_LIFE), not by iterations."""
        decay = 0.5 ** (1.0 / PROMPT_HALF_LIFE)
        for mean in (*self._prompt_predicted.values(), *self._prompt_accepted.values()):
            mean.fade(decay)
        self._prompt_predicted.setdefault(source, _Mean()).add(predicted)
        self._prompt_accepted.setdefault(source, _Mean()).add(float(accepted))

    def prompt_calibration(self, source: str) -> float:
        """c_s of `source`'s drafts on prompt passes, towards 1 while little is known."""
        return _calibration(self._prompt_predicted.get(source), self._prompt_accepted.get(source))

    def observe_tokens(self, *, model_side: int, tokens: int) -> None:
        """One iteration's emitted tokens, `model_side` of them without a model-free draft."""
        if tokens > 0:
            self._model_side.fade(0.5 ** (1.0 / self.half_life))
            self._model_side.add(model_side / tokens, weight=tokens)

    def forget_acceptance(self) -> None:
        """Keep W(r) and B, drop c_s and the model-side share (see PairEstimates.forget_acceptance)."""
        self._predicted.clear()
        self._accepted.clear()
        self._prompt_predicted.clear()
        self._prompt_accepted.clear()
        self._model_side = _Mean()

    def model_side_share(self) -> float:
        """The recent share of tokens made without a model-free draft (nan before any)."""
        return self._model_side.value

    def calibration(self, source: str) -> float:
        """c_s: accepted ÷ predicted tokens of the source's drafts, towards 1 while little is known."""
        return _calibration(self._predicted.get(source), self._accepted.get(source))

    def batch_calls(self) -> float:
        """B: the recent mean of calls per verifier pass (1 before any)."""
        return self._calls.value if self._calls.weight > 0 else 1.0

    def iteration_seconds(self, positions: int) -> float:
        """W(B·n): an iteration verifying n positions, charged the pass it makes when each of the
        pass's B calls verifies as many (class docstring; nan before any measurement)."""
        return _line_seconds(self._wall, self.batch_calls() * positions)

    def node_cap(self, floor: int, ceiling: int) -> int:
        """The most nodes a model-free draft may have: the largest m in [floor, ceiling] whose pass,
        W(m + 1), costs at most DRAFT_COST_STEPS target-only steps, W(1). Cheap wide passes (a CPU
        with AMX, a GPU) raise it, expensive ones keep it at `floor` (the configured cap); `floor`
        too until two pass sizes were measured (the line's slope is then a prior, not this machine's)."""
        if ceiling <= floor or len({size for size, m in self._wall.items() if m.weight > 0}) < 2:
            return floor
        step = self.iteration_seconds(1)
        per_node = self.iteration_seconds(2) - step  # W is a line in the positions: W(m + 1) = W(1) + m·this
        if not math.isfinite(step):
            return floor
        if per_node <= 0:
            return ceiling
        affordable = math.floor((DRAFT_COST_STEPS - 1.0) * step / per_node)
        return max(floor, min(ceiling, affordable))
