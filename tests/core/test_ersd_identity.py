"""ERSD with position-keyed races: output identical to target-only race decoding, whatever the drafter.

Together with the race winner being distributed exactly as its distribution (checked here
statistically, and a property of independent exponentials), this is the proof that ERSD is
exact (see test_fidelity_exact.test_ersd_equals_race_decoding for the argument).
"""

from __future__ import annotations

import random

import pytest
import torch
from scipy.stats import chisquare

from specdec.drafting import draft_tree
from specdec.races import race, race_winner, race_winner_at
from specdec.trees import optimal_tree_shape
from specdec.verification import ersd as ersd_module
from specdec.verification.base import MethodParams
from specdec.verification.dispatch import verify

from .helpers_toy_models import SAMPLING_VARIANTS, Warped, anti_model, random_markov


def ersd_generate(
    target: Warped, draft: Warped, shape: tuple[int, ...], seed: int, prompt: list[int], length: int
) -> tuple[list[int], int]:
    """Run ERSD iterations until `length` new tokens exist; returns (new tokens, drafts accepted)."""
    tokens = list(prompt)
    accepted = 0
    while len(tokens) - len(prompt) < length:
        position = len(tokens)
        prefix = list(tokens)
        tree, _ = draft_tree(
            shape,
            lambda path, prefix=prefix: draft.probs(prefix + path),
            "race",
            seed=seed,
            position=position,
        )
        contexts = [prefix] + [prefix + tree.path_tokens(i) for i in range(len(tree))]
        result = verify(
            "ersd", tree, target.rows_for(contexts), None, MethodParams(seed=seed, position=position)
        )
        assert len(result.tokens) == result.num_accepted + 1
        assert result.tokens[:-1] == [tree.tokens[n] for n in result.accepted_nodes]
        accepted += result.num_accepted
        tokens.extend(result.tokens)
    return tokens[len(prompt) :], accepted


def race_decode(target: Warped, seed: int, prompt: list[int], length: int) -> list[int]:
    """Target-only decoding that emits argmin e_n / P_n at every absolute position n."""
    tokens = list(prompt)
    for _ in range(length):
        tokens.append(race_winner(race(seed, len(tokens), target.vocab), target.probs(tokens)))
    return tokens[len(prompt) :]


def random_shape(rng: random.Random) -> tuple[int, ...]:
    kind = rng.choice(["sequence", "star", "tree", "optimal"])
    k = rng.randint(1, 5)
    if kind == "sequence":
        return tuple(range(-1, k - 1))
    if kind == "star":
        return (-1,) * k
    if kind == "tree":
        return tuple(rng.randint(-1, i - 1) for i in range(k))
    rates = sorted((rng.random() for _ in range(3)), reverse=True)
    return tuple(optimal_tree_shape(rates, k))


def random_case(case: int) -> tuple[Warped, Warped, tuple[int, ...], list[int]]:
    rng = random.Random(case)
    vocab = rng.randint(4, 8)
    sampling = rng.choice(list(SAMPLING_VARIANTS.values()))
    target_model = random_markov(vocab, rng.choice([1, 2]), seed=rng.randrange(10**6))
    drafter_kind = rng.choice(["random", "terrible", "same"])
    if drafter_kind == "random":
        draft_model = random_markov(vocab, rng.choice([1, 2]), seed=rng.randrange(10**6), sharpness=3.0)
    elif drafter_kind == "terrible":
        draft_model = anti_model(target_model)
    else:
        draft_model = target_model
    prompt = [rng.randrange(vocab) for _ in range(rng.randint(0, 3))]
    return Warped(target_model, sampling), Warped(draft_model, sampling), random_shape(rng), prompt


@pytest.mark.parametrize("case", range(40))
def test_ersd_output_equals_race_decoding(case: int) -> None:
    target, draft, shape, prompt = random_case(case)
    for seed in range(case * 100, case * 100 + 6):
        out, _ = ersd_generate(target, draft, shape, seed, prompt, 10)
        assert out == race_decode(target, seed, prompt, len(out)), (shape, seed)


@pytest.mark.parametrize("shape", [(-1, 0, 1, 2), (-1, -1, -1), (-1, -1, 0, 0, 1, 2)])
def test_identity_holds_for_any_drafter(shape: tuple[int, ...]) -> None:
    """Good, random and adversarial drafters give the same output for the same seed."""
    target_model = random_markov(6, 2, seed=11)
    target = Warped(target_model)
    drafters = [target_model, random_markov(6, 1, seed=12), anti_model(target_model)]
    for seed in range(10):
        outputs = [ersd_generate(target, Warped(d), shape, seed, [1], 8)[0][:8] for d in drafters]
        assert outputs[0] == outputs[1] == outputs[2] == race_decode(target, seed, [1], 8)


def test_drafter_equal_to_target_accepts_every_sequence_draft() -> None:
    """Race drafting with q = p proposes exactly the race winners, so every draft is accepted."""
    model = random_markov(5, 2, seed=3)
    target = Warped(model)
    k = 4
    for seed in range(20):
        out, accepted = ersd_generate(target, Warped(model), tuple(range(-1, k - 1)), seed, [], 3 * (k + 1))
        assert len(out) == 3 * (k + 1) and accepted == 3 * k


def test_identity_catches_a_race_keyed_on_the_wrong_position(monkeypatch: pytest.MonkeyPatch) -> None:
    """Keying every depth's race on the iteration's first position breaks the identity."""
    def keyed_on_zero(seed: int, position: int, dist):
        return race_winner_at(seed, 0, dist)

    monkeypatch.setattr(ersd_module, "race_winner_at", keyed_on_zero)
    target, draft, _, _ = random_case(0)
    mismatches = 0
    for seed in range(20):
        out, _ = ersd_generate(target, draft, (-1, 0, 1), seed, [], 8)
        mismatches += out != race_decode(target, seed, [], len(out))
    assert mismatches > 0


# --- the race itself ---------------------------------------------------------------------------

DIST = torch.tensor([0.3, 0.0, 0.15, 0.05, 0.25, 0.0, 0.2, 0.05], dtype=torch.float64)


def test_race_winner_is_distributed_as_d() -> None:
    """Chi-square over 6000 seeds (positions vary too); zero-probability tokens never win."""
    counts = torch.zeros(len(DIST))
    for seed in range(6000):
        counts[race_winner(race(seed, seed % 7, len(DIST)), DIST)] += 1
    support = DIST > 0
    assert counts[~support].sum() == 0
    expected = DIST[support] * counts.sum()
    assert chisquare(counts[support].numpy(), expected.numpy()).pvalue > 1e-3


def test_races_at_different_positions_are_independent() -> None:
    """Joint winners at positions n and n + 1 follow D ⊗ D (chi-square on the 16 pairs)."""
    d = torch.tensor([0.4, 0.3, 0.2, 0.1], dtype=torch.float64)
    counts = torch.zeros(4, 4)
    for seed in range(4000):
        counts[race_winner(race(seed, 5, 4), d), race_winner(race(seed, 6, 4), d)] += 1
    expected = torch.outer(d, d) * counts.sum()
    assert chisquare(counts.flatten().numpy(), expected.flatten().numpy()).pvalue > 1e-3


def test_chi_square_catches_a_biased_winner() -> None:
    """The same check rejects a winner rule that is not exact (argmin e·D instead of e/D)."""
    counts = torch.zeros(len(DIST))
    support = DIST > 0
    for seed in range(6000):
        e = race(seed, 0, len(DIST))
        counts[int(torch.argmin(torch.where(support, e * DIST, torch.inf)))] += 1
    expected = DIST[support] * counts.sum()
    assert chisquare(counts[support].numpy(), expected.numpy()).pvalue < 1e-3
