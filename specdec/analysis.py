"""Measuring a draft/target pair and turning the measurements into a plan (docs/algorithms.md §5–§7).

What is measured, and how:
- (p, q) rows: the TARGET samples a continuation of each prompt at the requested sampling
  parameters (so the committed text is distributed as in real use); then ONE forward pass of
  each model over prompt + continuation gives the warped next-token rows at every continuation
  position. No speculative loop is needed: every acceptance statistic is a function of rows.
- Rank acceptance R(j) for trees: Monte Carlo on the measured rows — recursive rejection
  (docs/algorithms.md §3, children drawn from Q without replacement) and exponential races (§4, the
  children are Q's first arrivals). Each row is restricted to the tokens carrying all but
  `tail_mass` of p's and q's mass plus one lumped "other" symbol, which keeps a 150k-token
  vocabulary cheap; R(1) is checked against its exact value (1 − TV, resp. the ERSD match
  probability) in the tests.
- Block vs token verification: the project's own `verify` run on windows of k + 1 consecutive
  measured rows, treating them as the rows along the draft path (the same context-free
  approximation that the i.i.d. formulas make).
- Timing: forward passes through the engines' tree KV cache (`TreeKVCache`) on a cached context:
  one token (T_p, T_q) and n tokens (the verifier's cost of scoring a draft of n − 1 tokens).

Everything else is the formulas of specdec.theory evaluated on these measurements. Nothing here
does file I/O; rendering and saving live in the adapters (specdec.cli.analyze, bench).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import torch

from specdec import theory
from specdec.randomness import TorchRandomSource, make_generator
from specdec.sampling import SamplingParams, warp_logits
from specdec.trees import DraftTree, max_depth, node_depths, optimal_tree_shape, sequence_parents
from specdec.verification.base import MethodParams
from specdec.verification.dispatch import verify

Progress = Callable[[str], None]
DEFAULT_TIMING_SIZES = (1, 2, 3, 5, 9, 17)


# ----------------------------------------------------------------------------------------------
# measuring rows
# ----------------------------------------------------------------------------------------------
@dataclass
class PromptRows:
    """Warped rows of both models at each continuation position of one prompt.

    target_rows[i] / draft_rows[i] are the distributions of continuation[i] given
    prompt + continuation[:i]; float32 [n, V].
    """

    prompt_ids: list[int]
    continuation: list[int]
    target_rows: torch.Tensor
    draft_rows: torch.Tensor

    def __len__(self) -> int:
        return len(self.continuation)


def _device(model) -> torch.device:
    return next(model.parameters()).device


@torch.no_grad()
def sample_continuation(
    model,
    prompt_ids: Sequence[int],
    max_new_tokens: int,
    sampling: SamplingParams,
    seed: int = 0,
    stop_ids: Sequence[int] = (),
) -> list[int]:
    """Target-only sampling with a KV cache from the warped rows (the exact target distribution)."""
    from transformers import DynamicCache

    if not prompt_ids:
        raise ValueError("the prompt must hold at least one token")
    device = _device(model)
    generator = make_generator(seed, "analysis-continuation")
    cache = DynamicCache(config=model.config)
    ids = torch.tensor([list(prompt_ids)], dtype=torch.long, device=device)
    out: list[int] = []
    stops = set(int(s) for s in stop_ids)
    for _ in range(max_new_tokens):
        logits = model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1).logits[0, -1]
        probs = warp_logits(logits.float().cpu(), sampling).double()
        token = int(torch.multinomial(probs, 1, generator=generator).item())
        out.append(token)
        if token in stops:
            break
        ids = torch.tensor([[token]], dtype=torch.long, device=device)
    return out


@torch.no_grad()
def warped_rows(
    model, prompt_ids: Sequence[int], continuation: Sequence[int], sampling: SamplingParams
) -> torch.Tensor:
    """Rows for every continuation token, from one forward pass over prompt + continuation[:-1]."""
    n = len(continuation)
    if n == 0:
        return torch.zeros((0, 0))
    ids = list(prompt_ids) + list(continuation[:-1])
    input_ids = torch.tensor([ids], dtype=torch.long, device=_device(model))
    logits = model(input_ids=input_ids, use_cache=False, logits_to_keep=n).logits[0].float().cpu()
    return warp_logits(logits, sampling).float()


def measure_rows(
    target_model,
    draft_model,
    prompts: Sequence[Sequence[int]],
    sampling: SamplingParams,
    max_new_tokens: int,
    seed: int = 0,
    stop_ids: Sequence[int] = (),
    progress: Progress | None = None,
) -> list[PromptRows]:
    """(p, q) rows along target-sampled continuations of every prompt."""
    out = []
    for index, prompt in enumerate(prompts):
        if progress:
            progress(f"prompt {index + 1}/{len(prompts)}: sampling {max_new_tokens} tokens from the target")
        continuation = sample_continuation(
            target_model, prompt, max_new_tokens, sampling, seed + index, stop_ids
        )
        p = warped_rows(target_model, prompt, continuation, sampling)
        q = warped_rows(draft_model, prompt, continuation, sampling)
        if p.shape != q.shape:
            raise ValueError(
                f"draft and target rows differ in shape: {tuple(q.shape)} vs {tuple(p.shape)} "
                "(do the models share a vocabulary?)"
            )
        out.append(PromptRows(list(prompt), continuation, p, q))
    return out


# ----------------------------------------------------------------------------------------------
# timing
# ----------------------------------------------------------------------------------------------
@dataclass
class Timing:
    """Forward times (seconds) of n new tokens on a cached context of `context_len` tokens
    (fastest of the repeats, made non-decreasing in n; see `measure_timing`)."""

    target_seconds: dict[int, float]
    draft_seconds: dict[int, float]
    context_len: int = 0
    threads: int = 0

    @property
    def t_p(self) -> float:
        return self.target_seconds[1]

    @property
    def t_q(self) -> float:
        return self.draft_seconds[1]

    @property
    def c(self) -> float:
        """Cost ratio c = T_target / T_draft of one decoding step (docs/algorithms.md §7)."""
        return self.t_p / self.t_q

    @property
    def lam(self) -> float:
        """λ = T_q / T_p (Toner et al.; docs/algorithms.md §5)."""
        return self.t_q / self.t_p

    def target_time(self, n: int) -> float:
        return _interpolate(self.target_seconds, n)

    def draft_time(self, n: int) -> float:
        return _interpolate(self.draft_seconds, n)

    def to_dict(self) -> dict[str, Any]:
        return {
            "target_seconds": {str(k): v for k, v in sorted(self.target_seconds.items())},
            "draft_seconds": {str(k): v for k, v in sorted(self.draft_seconds.items())},
            "context_len": self.context_len,
            "threads": self.threads,
            "t_p": self.t_p,
            "t_q": self.t_q,
            "c": self.c,
            "lambda": self.lam,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Timing:
        return cls(
            {int(k): float(v) for k, v in data["target_seconds"].items()},
            {int(k): float(v) for k, v in data["draft_seconds"].items()},
            int(data.get("context_len", 0)),
            int(data.get("threads", 0)),
        )


def _interpolate(table: dict[int, float], n: int) -> float:
    """Piecewise-linear in n through the measured sizes; linear extrapolation past the last two."""
    xs = sorted(table)
    if n in table:
        return table[n]
    if len(xs) == 1:
        return table[xs[0]]
    if n <= xs[0]:
        return table[xs[0]]
    for lo, hi in zip(xs, xs[1:], strict=False):
        if lo <= n <= hi:
            return table[lo] + (table[hi] - table[lo]) * (n - lo) / (hi - lo)
    lo, hi = xs[-2], xs[-1]
    slope = max(0.0, (table[hi] - table[lo]) / (hi - lo))
    return table[hi] + slope * (n - hi)


def _time_model(
    model, context: Sequence[int], sizes: Sequence[int], repeats: int, warmup: int
) -> dict[int, float]:
    from specdec.runtime.kv import TreeKVCache

    kv = TreeKVCache(model)
    kv.extend_chain(list(context))
    kv.settle(list(range(len(context))))
    base = kv.prefix_len
    vocab_tokens = [int(t) for t in context[-max(sizes) :]] or [0]
    out: dict[int, float] = {}
    for n in sizes:
        tokens = [vocab_tokens[i % len(vocab_tokens)] for i in range(n)]
        samples = []
        for r in range(warmup + repeats):
            began = time.perf_counter()
            kv.extend(tokens, sequence_parents(n), rows_from=0)  # every row projected, as in scoring
            elapsed = time.perf_counter() - began
            kv.truncate(base)
            if r >= warmup:
                samples.append(elapsed)
        # The fastest repeat: other processes on the machine only ever add time, so the minimum
        # is the estimate of what the hardware does; a pass over more tokens never costs less.
        best = float(min(samples))
        out[int(n)] = max(best, max(out.values(), default=0.0))
    return out


def measure_timing(
    target_model,
    draft_model,
    context: Sequence[int],
    sizes: Sequence[int] = DEFAULT_TIMING_SIZES,
    repeats: int = 5,
    warmup: int = 1,
) -> Timing:
    """T_p(n), T_q(n): time of a forward pass over n new tokens after `context` (cached).

    The fastest of `repeats` runs after `warmup` (robust to other processes sharing the CPU),
    made non-decreasing in n.
    Uses the engines' own cache (tree attention mask, explicit position ids), so the numbers are
    what a drafter step (n = 1) and a verifier pass over a draft of n − 1 tokens cost.
    """
    sizes = sorted({int(s) for s in sizes} | {1})
    if not context:
        raise ValueError("timing needs a context of at least one token")
    return Timing(
        _time_model(target_model, context, sizes, repeats, warmup),
        _time_model(draft_model, context, sizes, repeats, warmup),
        context_len=len(context),
        threads=torch.get_num_threads(),
    )


# ----------------------------------------------------------------------------------------------
# rank acceptance (Monte Carlo on measured rows)
# ----------------------------------------------------------------------------------------------
def _compact(
    p: np.ndarray, q: np.ndarray, tail_mass: float, max_support: int
) -> tuple[np.ndarray, np.ndarray, float]:
    """Restrict a row pair to the tokens holding all but `tail_mass` of p and of q; the rest
    becomes one lumped symbol (last entry). Returns (p', q', mass moved into the lump)."""
    keep = np.zeros(p.shape[0], dtype=bool)
    for row in (p, q):
        order = np.argsort(-row, kind="stable")
        cum = np.cumsum(row[order])
        count = int(np.searchsorted(cum, cum[-1] * (1.0 - tail_mass), side="left")) + 1
        keep[order[: min(count, max_support)]] = True
    p_rest, q_rest = float(p[~keep].sum()), float(q[~keep].sum())
    pc = np.concatenate([p[keep], [p_rest]])
    qc = np.concatenate([q[keep], [q_rest]])
    return pc / pc.sum(), qc / qc.sum(), max(p_rest, q_rest)


def _row_pairs(p_rows: torch.Tensor, q_rows: torch.Tensor, tail_mass: float, max_support: int):
    for i in range(p_rows.shape[0]):
        p = p_rows[i].double().numpy()
        q = q_rows[i].double().numpy()
        yield _compact(p, q, tail_mass, max_support)


def _gsd_ranks_one(
    p: np.ndarray, q: np.ndarray, ranks: int, samples: int, rng: np.random.Generator
) -> np.ndarray:
    """Recursive rejection (docs/algorithms.md §3) for `samples` independent nodes at once: hits per rank."""
    s = samples
    p_star = np.tile(p, (s, 1))
    q_star = np.tile(q, (s, 1))
    alive = np.ones(s, dtype=bool)
    hits = np.zeros(ranks)
    rows = np.arange(s)
    for j in range(ranks):
        if not alive.any():
            break
        cum = np.cumsum(q_star, axis=1)
        u = rng.random(s) * cum[:, -1]
        x = np.minimum((cum < u[:, None]).sum(axis=1), q.shape[0] - 1)
        qx = q_star[rows, x]
        px = p_star[rows, x]
        with np.errstate(divide="ignore", invalid="ignore"):
            ratio = np.where(qx > 0, px / np.where(qx > 0, qx, 1.0), 0.0)
        accept = alive & (qx > 0) & (rng.random(s) < ratio)
        hits[j] += accept.sum()
        alive &= ~accept
        # Rejected: P* ← norm((P* − Q*)+), then Q*(x) ← 0, Q* ← norm(Q*).
        residual = np.clip(p_star - q_star, 0.0, None)
        mass = residual.sum(axis=1, keepdims=True)
        p_star = np.where(mass > 0, residual / np.where(mass > 0, mass, 1.0), p_star)
        q_star[rows, x] = 0.0
        q_mass = q_star.sum(axis=1, keepdims=True)
        alive &= q_mass[:, 0] > 0
        q_star = np.where(q_mass > 0, q_star / np.where(q_mass > 0, q_mass, 1.0), q_star)
    return hits


def _ersd_ranks_one(
    p: np.ndarray, q: np.ndarray, ranks: int, samples: int, rng: np.random.Generator
) -> np.ndarray:
    """Exponential races (docs/algorithms.md §4): hits where P's winner is Q's j-th arrival."""
    e = rng.exponential(size=(samples, p.shape[0]))
    with np.errstate(divide="ignore"):
        q_times = np.where(q > 0, e / np.where(q > 0, q, 1.0), np.inf)
        p_times = np.where(p > 0, e / np.where(p > 0, p, 1.0), np.inf)
    winner = np.argmin(p_times, axis=1)
    m = min(ranks, q.shape[0])
    first = (
        np.argpartition(q_times, m - 1, axis=1)[:, :m]
        if m < q.shape[0]
        else np.tile(np.arange(m), (samples, 1))
    )
    order = np.take_along_axis(first, np.argsort(np.take_along_axis(q_times, first, axis=1), axis=1), axis=1)
    finite = np.isfinite(np.take_along_axis(q_times, order, axis=1))
    match = (order == winner[:, None]) & finite
    hits = np.zeros(ranks)
    hits[:m] = match.sum(axis=0)
    return hits


def rank_acceptance(
    p_rows: torch.Tensor,
    q_rows: torch.Tensor,
    kind: str,
    ranks: int = 8,
    samples: int = 256,
    seed: int = 0,
    tail_mass: float = 1e-4,
    max_support: int = 4096,
) -> tuple[np.ndarray, float]:
    """(R(1..ranks), largest lumped mass) for `kind` "gsd" (recursive rejection) or "ersd" (races).

    R(j) = probability that the j-th ranked child of a node is the accepted one, averaged over
    the rows (ERSD paper's 0th-order acceptance model), estimated with `samples` nodes per row.
    """
    if kind not in ("gsd", "ersd"):
        raise ValueError(f"kind must be 'gsd' or 'ersd', got {kind!r}")
    if p_rows.shape != q_rows.shape or p_rows.ndim != 2 or p_rows.shape[0] == 0:
        raise ValueError("need matching non-empty [n, V] row tensors")
    rng = np.random.default_rng(seed)
    fn = _gsd_ranks_one if kind == "gsd" else _ersd_ranks_one
    hits = np.zeros(ranks)
    lumped = 0.0
    for p, q, moved in _row_pairs(p_rows, q_rows, tail_mass, max_support):
        hits += fn(p, q, ranks, samples, rng)
        lumped = max(lumped, moved)
    return hits / (samples * p_rows.shape[0]), lumped


def monotone(rates: Sequence[float]) -> list[float]:
    """Running minimum: the tree planner assumes R non-increasing in rank (Monte Carlo noise aside)."""
    out: list[float] = []
    for r in rates:
        out.append(min(float(r), out[-1]) if out else float(r))
    return out


# ----------------------------------------------------------------------------------------------
# token vs block verification on measured windows
# ----------------------------------------------------------------------------------------------
def simulate_sequence_tokens(
    rows: Sequence[PromptRows], method: str, k: int, samples: int = 8, max_windows: int = 64, seed: int = 0
) -> float:
    """Mean tokens per iteration of `method` ("token" | "block") with k drafts, on measured windows.

    A window is k + 1 consecutive measured positions, taken as the rows along the draft path;
    drafts are drawn from the window's q rows and checked by the project's `verify`.
    """
    windows = [(i, s) for i, pr in enumerate(rows) for s in range(len(pr) - k)]
    if not windows:
        raise ValueError(f"no prompt has {k + 1} measured positions")
    rng = np.random.default_rng(seed)
    if len(windows) > max_windows:
        windows = [windows[i] for i in sorted(rng.choice(len(windows), max_windows, replace=False))]
    total, count = 0, 0
    for w, (i, s) in enumerate(windows):
        p = rows[i].target_rows[s : s + k + 1]
        q = rows[i].draft_rows[s : s + k + 1]
        for j in range(samples):
            gen = make_generator(seed, "window", method, k, w, j)
            tokens = [int(torch.multinomial(q[d].double(), 1, generator=gen).item()) for d in range(k)]
            source = TorchRandomSource.from_seed(seed, "verify", method, k, w, j)
            result = verify(method, DraftTree.sequence(tokens), p, q, MethodParams(), source)
            total += len(result.tokens)
            count += 1
    return total / count


# ----------------------------------------------------------------------------------------------
# the analysis
# ----------------------------------------------------------------------------------------------
def tree_level_widths(parents: Sequence[int]) -> list[int]:
    """How many nodes sit at each depth 1, 2, … (a tree's drafter passes draft one level each)."""
    depths = node_depths(parents)
    return [depths.count(d) for d in range(1, max(depths, default=0) + 1)]


@dataclass
class Analysis:
    """Everything `specdec analyze` reports; `to_dict()` is the JSON form (plots read that)."""

    meta: dict[str, Any]
    acceptance: dict[str, Any]
    entropy: dict[str, Any]
    rank_acceptance: dict[str, list[float]]
    timing: Timing
    block_simulation: dict[str, dict[str, float]]  # method → {k: tokens per iteration}
    rd_alpha: dict[str, list[float]]  # {"a": grid, "alpha": α(a)}
    plan: dict[str, Any] = field(default_factory=dict)
    bounds: dict[str, Any] = field(default_factory=dict)
    curves: dict[str, Any] = field(default_factory=dict)

    # predictions ------------------------------------------------------------------------------
    def alpha_of_a(self, a: float) -> float:
        grid, alpha = self.rd_alpha["a"], self.rd_alpha["alpha"]
        return float(np.clip(np.interp(a, grid, alpha), 0.0, 1.0))

    def predict(
        self, method: str, k: int | None = None, a: float | None = None, tree_budget: int | None = None
    ) -> dict[str, float]:
        """Expected tokens per iteration and speedup over target-only decoding for one configuration.

        `speedup_formula` is docs/algorithms.md §7 (a verifier pass costs T_p whatever its size, a drafter
        step T_p/c); `speedup_timed` uses the measured T_p(n) and T_q(n) instead.
        """
        t = self.timing
        if method == "autoregressive":
            return {"expected_tokens": 1.0, "speedup_formula": 1.0, "speedup_timed": 1.0}
        if method in ("token", "block", "ersd") and tree_budget is None:
            k = int(k or self.plan["sequence"]["best_k_timed"])
            if method == "block":
                tokens = self.block_simulation.get("block", {}).get(str(k))
                if tokens is None:  # not simulated at this k: token verification's value is a lower bound
                    tokens = theory.expected_tokens_per_iteration(self.acceptance["alpha"], k)
            else:
                alpha = self.acceptance["alpha"] if method == "token" else self.acceptance["ersd_alpha"]
                tokens = theory.expected_tokens_per_iteration(alpha, k)
            return {
                "expected_tokens": tokens,
                "speedup_formula": tokens / (1.0 + k / t.c),
                "speedup_timed": tokens * t.t_p / (k * t.t_q + t.target_time(k + 1)),
            }
        if method in ("gsd-tree", "ersd"):
            budget = int(tree_budget or k or self.plan["tree"]["gsd"]["budget"])
            rates = monotone(self.rank_acceptance["gsd" if method == "gsd-tree" else "ersd"])
            parents = optimal_tree_shape(rates, budget)
            tokens = theory.optimal_tree_expected_tokens(rates, budget)
            draft_time = sum(t.draft_time(w) for w in tree_level_widths(parents))
            return {
                "expected_tokens": tokens,
                "speedup_formula": tokens / (1.0 + max_depth(parents) / t.c),
                "speedup_timed": tokens * t.t_p / (draft_time + t.target_time(budget + 1)),
            }
        if method == "rd":
            schedule = self.plan["rd"]["schedule"]
            a = float(schedule["a"] if a is None else a)
            k_max = int(k or schedule["k_max"])
            alpha = self.alpha_of_a(a)
            formula = theory.rd_tokens_per_second(a, k_max, alpha, t.t_q, t.t_p, t.t_p) * t.t_p
            timed = theory.rd_tokens_per_second(a, k_max, alpha, t.t_q, t.t_p, t.target_time) * t.t_p
            tokens = (1.0 - a) + sum(
                (a**j * ((1.0 - a) if j < k_max else 1.0)) * theory.expected_tokens_per_iteration(alpha, j)
                for j in range(1, k_max + 1)
            )
            return {"expected_tokens": tokens, "speedup_formula": formula, "speedup_timed": timed}
        raise ValueError(f"no prediction for method {method!r}")

    def to_dict(self) -> dict[str, Any]:
        return json_safe(
            {
                "meta": self.meta,
                "acceptance": self.acceptance,
                "entropy": self.entropy,
                "rank_acceptance": self.rank_acceptance,
                "timing": self.timing.to_dict(),
                "block_simulation": self.block_simulation,
                "rd_alpha": self.rd_alpha,
                "plan": self.plan,
                "bounds": self.bounds,
                "curves": self.curves,
            }
        )

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Analysis:
        return cls(
            meta=data["meta"],
            acceptance=data["acceptance"],
            entropy=data["entropy"],
            rank_acceptance=data["rank_acceptance"],
            timing=Timing.from_dict(data["timing"]),
            block_simulation=data["block_simulation"],
            rd_alpha=data["rd_alpha"],
            plan=data["plan"],
            bounds=data["bounds"],
            curves=data["curves"],
        )


def json_safe(value: Any) -> Any:
    """inf/nan → None, numpy scalars → Python numbers, tuples → lists (strict JSON)."""
    if isinstance(value, dict):
        return {str(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    if isinstance(value, (np.floating, float)):
        value = float(value)
        return value if math.isfinite(value) else None
    if isinstance(value, np.integer):
        return int(value)
    if isinstance(value, np.bool_):
        return bool(value)
    return value


def _safe(fn: Callable[[], float]) -> float | None:
    try:
        value = float(fn())
    except (ValueError, ZeroDivisionError, OverflowError):
        return None
    return value if math.isfinite(value) else None


def analyze_rows(
    rows: Sequence[PromptRows],
    timing: Timing,
    *,
    sampling: SamplingParams,
    draft_id: str = "draft",
    target_id: str = "target",
    k_max: int = 16,
    max_budget: int = 32,
    ranks: int = 8,
    rank_samples: int = 256,
    sim_samples: int = 8,
    sim_ks: Sequence[int] = (1, 2, 4, 8),
    a_grid: int = 101,
    seed: int = 0,
    progress: Progress | None = None,
) -> Analysis:
    """All statistics, the plan (best k, tree, a) and the bounds from measured rows and timings."""
    rows = [r for r in rows if len(r) > 0]
    if not rows:
        raise ValueError("no measured rows (every continuation is empty)")
    say = progress or (lambda message: None)
    p_all = torch.cat([r.target_rows for r in rows])
    q_all = torch.cat([r.draft_rows for r in rows])
    vocab = int(p_all.shape[1])

    say("acceptance statistics")
    alpha_rows = np.asarray(theory.acceptance_rate(p_all, q_all), dtype=np.float64).reshape(-1)
    longest = max(len(r) for r in rows)
    per_position = []
    offset = 0
    by_position: list[list[float]] = [[] for _ in range(longest)]
    per_prompt = []
    for r in rows:
        values = alpha_rows[offset : offset + len(r)]
        per_prompt.append(float(values.mean()))
        for i, v in enumerate(values):
            by_position[i].append(float(v))
        offset += len(r)
    per_position = [float(np.mean(v)) for v in by_position]
    kl = np.asarray(theory.kl_divergence(p_all, q_all), dtype=np.float64).reshape(-1)
    ce = np.asarray(theory.cross_entropy(p_all, q_all), dtype=np.float64).reshape(-1)
    acceptance = {
        "alpha": float(alpha_rows.mean()),
        "alpha_per_position": per_position,
        "alpha_per_prompt": per_prompt,
        "tv": float(1.0 - alpha_rows.mean()),
        "d_hm": float(np.mean(theory.harmonic_mean_divergence(p_all, q_all))),
        "ersd_alpha": float(np.mean(theory.ersd_acceptance(p_all, q_all))),
        "kl": float(kl.mean()),
        "kl_finite_fraction": float(np.isfinite(kl).mean()),
    }
    mu, mu2 = theory.entropy_moments(p_all)
    mu_ce, q_zero = theory.drafter_cross_entropy(p_all, q_all)
    entropy = {
        "mu": mu,
        "mu2": mu2,
        "cross_entropy": float(ce.mean()),
        "mu_ce": mu_ce,
        "prob_q_zero": q_zero,
        "draft_entropy": float(np.mean(theory.entropy(q_all))),
    }

    say("rank acceptance (recursive rejection and races)")
    r_gsd, lumped_g = rank_acceptance(p_all, q_all, "gsd", ranks, rank_samples, seed)
    r_ersd, lumped_e = rank_acceptance(p_all, q_all, "ersd", ranks, rank_samples, seed + 1)
    rank = {"gsd": [float(x) for x in r_gsd], "ersd": [float(x) for x in r_ersd]}

    say("token vs block verification on measured windows")
    ks = sorted({int(k) for k in sim_ks if 1 <= int(k) < longest})
    block_sim: dict[str, dict[str, float]] = {"token": {}, "block": {}}
    for k in ks:
        for method in ("token", "block"):
            block_sim[method][str(k)] = simulate_sequence_tokens(rows, method, k, sim_samples, seed=seed)

    say("randomised drafting")
    a_values = np.linspace(0.0, 1.0, a_grid)
    a_star, objective = theory.best_a(p_all, q_all, timing.lam)
    a_values = np.unique(np.concatenate([a_values, [a_star]]))
    alpha_a = np.clip(theory.rd_acceptance_curve(p_all, q_all, a_values), 0.0, 1.0)
    rd_alpha = {"a": [float(a) for a in a_values], "alpha": [float(x) for x in alpha_a]}
    schedule = theory.best_rd_schedule(
        p_all, q_all, timing.t_q, timing.t_p, timing.target_time, k_values=range(1, k_max + 1)
    )
    threshold = theory.lemma_4_3_threshold(p_all, q_all)

    analysis = Analysis(
        meta={
            "draft_id": draft_id,
            "target_id": target_id,
            "vocab": vocab,
            "sampling": asdict(sampling),
            "prompts": len(rows),
            "rows": int(p_all.shape[0]),
            "seed": seed,
            "rank_samples": rank_samples,
            "sim_samples": sim_samples,
            "lumped_tail_mass": max(lumped_g, lumped_e),
        },
        acceptance=acceptance,
        entropy=entropy,
        rank_acceptance=rank,
        timing=timing,
        block_simulation=block_sim,
        rd_alpha=rd_alpha,
    )
    alpha = acceptance["alpha"]
    k_best, s_best = theory.best_k(alpha, timing.c, k_max=k_max)
    timed = [(k, analysis_seq_timed(alpha, k, timing)) for k in range(1, k_max + 1)]
    k_timed, s_timed = max(timed, key=lambda kv: kv[1])
    analysis.plan = {
        "sequence": {
            "best_k": k_best,
            "speedup": s_best,
            "best_k_timed": k_timed,
            "speedup_timed": s_timed,
            "expected_tokens": theory.expected_tokens_per_iteration(alpha, k_best),
            # False: with the measured verifier cost T_p(k+1) no draft length beats the target alone
            "pays_timed": bool(s_timed > 1.0),
        },
        "tree": {kind: _best_tree(analysis, kind, max_budget) for kind in ("gsd", "ersd")},
        "rd": {
            "best_a_k1": a_star,
            "objective_k1": objective,
            "lambda": timing.lam,
            "lemma_4_3_threshold": threshold,
            "lemma_4_3_holds": bool(timing.lam >= threshold),
            "schedule": {
                "a": schedule.a,
                "k_max": schedule.k_max,
                "alpha": schedule.acceptance,
                "tokens_per_second": schedule.tokens_per_second,
                "speedup_timed": schedule.tokens_per_second * timing.t_p,
            },
        },
    }
    plan = analysis.plan
    methods = {
        "token": ("token", {"k": k_timed}),
        "block": ("block", {"k": k_timed}),
        "ersd": ("ersd", {"k": k_timed}),
        "gsd-tree": ("gsd-tree", {"tree_budget": plan["tree"]["gsd"]["budget"]}),
        "ersd-tree": ("ersd", {"tree_budget": plan["tree"]["ersd"]["budget"]}),
        "rd": ("rd", {"a": schedule.a, "k": schedule.k_max}),
        "rd-k1": ("rd", {"a": a_star, "k": 1}),
    }
    plan["methods"] = {
        name: {**args, **analysis.predict(method, **args)} for name, (method, args) in methods.items()
    }
    if k_timed not in ks and 1 <= k_timed < longest:
        for method in ("token", "block"):
            block_sim[method][str(k_timed)] = simulate_sequence_tokens(
                rows, method, k_timed, sim_samples, seed=seed
            )
        plan["methods"]["block"].update(analysis.predict("block", k=k_timed))

    say("bounds and curves")
    budget = plan["tree"]["ersd"]["budget"]
    analysis.bounds = _bounds(analysis, vocab, budget)
    analysis.curves = _curves(analysis, vocab, k_max, max_budget)
    return analysis


def analysis_seq_timed(alpha: float, k: int, timing: Timing) -> float:
    tokens = theory.expected_tokens_per_iteration(alpha, k)
    return tokens * timing.t_p / (k * timing.t_q + timing.target_time(k + 1))


def _best_tree(analysis: Analysis, kind: str, max_budget: int) -> dict[str, Any]:
    method = "gsd-tree" if kind == "gsd" else "ersd"
    best: dict[str, Any] | None = None
    for budget in range(1, max_budget + 1):
        pred = analysis.predict(method, tree_budget=budget)
        if best is None or pred["speedup_timed"] > best["speedup_timed"]:
            best = {"budget": budget, **pred}
    assert best is not None
    parents = optimal_tree_shape(monotone(analysis.rank_acceptance[kind]), best["budget"])
    best["parents"] = parents
    best["depth"] = max_depth(parents)
    return best


def _complete(rates: Sequence[float]) -> list[float]:
    """R(1..m) plus the rest as one symbol: a complete distribution whose entropy is a lower bound
    of H[R] over all ranks (so the Tunstall bound computed from it stays a valid upper bound)."""
    rates = [max(0.0, float(r)) for r in rates]
    rest = max(0.0, 1.0 - sum(rates))
    return rates + ([rest] if rest > 0 else [])


def _bounds(analysis: Analysis, vocab: int, budget: int) -> dict[str, Any]:
    mu, mu2 = analysis.entropy["mu"], analysis.entropy["mu2"]
    out: dict[str, Any] = {"budget": budget, "p_cap": budget + 1}
    for kind in ("gsd", "ersd"):
        rates = monotone(analysis.rank_acceptance[kind])
        h = theory.rank_entropy(_complete(rates))
        out[f"h_r_{kind}"] = h
        out[f"tunstall_{kind}"] = _safe(lambda h=h: theory.tunstall_bound(vocab, budget, h))
        out[f"tunstall_refined_{kind}"] = _safe(lambda r=rates: theory.tunstall_bound_refined(r, budget))
    out["speed_of_light"] = _safe(lambda: theory.speed_of_light_bound(mu, mu2, budget + 1))
    out["speed_of_light_min_p_cap"] = _safe(lambda: 1.0 + mu2 / (mu * mu))
    out["speed_of_light_asymptotic"] = _safe(lambda: theory.speed_of_light_asymptotic(mu, budget + 1))
    out["speed_of_light_drafter"] = _safe(
        lambda: theory.speed_of_light_drafter(
            analysis.entropy["mu_ce"], budget + 1, analysis.entropy["prob_q_zero"]
        )
    )
    out["kl_le_h_r_ersd"] = analysis.acceptance["kl"] <= out["h_r_ersd"]
    return out


def _curves(analysis: Analysis, vocab: int, k_max: int, max_budget: int) -> dict[str, Any]:
    t = analysis.timing
    ks = list(range(1, k_max + 1))
    speedup = {
        "k": ks,
        "token_formula": [analysis.predict("token", k=k)["speedup_formula"] for k in ks],
        "token_timed": [analysis.predict("token", k=k)["speedup_timed"] for k in ks],
        "ersd_formula": [analysis.predict("ersd", k=k)["speedup_formula"] for k in ks],
        "block_sim_k": [int(k) for k in analysis.block_simulation["block"]],
        "block_sim_formula": [
            v / (1.0 + int(k) / t.c) for k, v in analysis.block_simulation["block"].items()
        ],
    }
    a_values = analysis.rd_alpha["a"]
    best_k = int(analysis.plan["rd"]["schedule"]["k_max"])
    tps = {
        "a": a_values,
        "alpha": analysis.rd_alpha["alpha"],
        "k_max": best_k,
        "relative_tps_k1": [analysis.predict("rd", a=a, k=1)["speedup_timed"] for a in a_values],
        "relative_tps_best_k": [analysis.predict("rd", a=a, k=best_k)["speedup_timed"] for a in a_values],
    }
    budgets = list(range(1, max_budget + 1))
    alpha, alpha_e = analysis.acceptance["alpha"], analysis.acceptance["ersd_alpha"]
    mu, mu2 = analysis.entropy["mu"], analysis.entropy["mu2"]
    tokens: dict[str, Any] = {
        "budget": budgets,
        "sequence_gsd": [theory.expected_tokens_per_iteration(alpha, b) for b in budgets],
        "sequence_ersd": [theory.expected_tokens_per_iteration(alpha_e, b) for b in budgets],
    }
    for kind in ("gsd", "ersd"):
        rates = monotone(analysis.rank_acceptance[kind])
        tokens[f"batch_{kind}"] = [1.0 + sum(rates[:b]) for b in budgets]
        tokens[f"tree_{kind}"] = [theory.optimal_tree_expected_tokens(rates, b) for b in budgets]
        tokens[f"tunstall_refined_{kind}"] = [
            _safe(lambda r=rates, b=b: theory.tunstall_bound_refined(r, b)) for b in budgets
        ]
    tokens["speed_of_light"] = [
        _safe(lambda b=b: theory.speed_of_light_bound(mu, mu2, b + 1)) for b in budgets
    ]
    return {"speedup_vs_k": speedup, "tps_vs_a": tps, "tokens_vs_budget": tokens}


def analyze(
    target_model,
    draft_model,
    prompts: Sequence[Sequence[int]],
    sampling: SamplingParams,
    *,
    max_new_tokens: int = 48,
    stop_ids: Sequence[int] = (),
    seed: int = 0,
    timing_sizes: Sequence[int] = DEFAULT_TIMING_SIZES,
    timing_repeats: int = 5,
    draft_id: str = "draft",
    target_id: str = "target",
    progress: Progress | None = None,
    **kwargs: Any,
) -> tuple[Analysis, list[PromptRows]]:
    """Measure rows and timings for a pair, then `analyze_rows`. Returns (analysis, rows)."""
    say = progress or (lambda message: None)
    rows = measure_rows(target_model, draft_model, prompts, sampling, max_new_tokens, seed, stop_ids, say)
    context = list(rows[0].prompt_ids) + list(rows[0].continuation)
    say(f"timing forward passes on a {len(context)}-token context")
    timing = measure_timing(target_model, draft_model, context, timing_sizes, timing_repeats)
    analysis = analyze_rows(
        rows,
        timing,
        sampling=sampling,
        draft_id=draft_id,
        target_id=target_id,
        seed=seed,
        progress=say,
        **kwargs,
    )
    analysis.meta["max_new_tokens"] = max_new_tokens
    return analysis, rows
