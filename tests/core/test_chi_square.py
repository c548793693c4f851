"""The pooled chi-square of fidelity testing (specdec.verification.fidelity) tells a law's samples
from another law's, and samples where the law has no mass fail it outright."""

import random

from specdec.verification.fidelity import chi_square_p

LAW = {("a",): 0.5, ("b",): 0.3, ("c",): 0.19, ("d",): 0.01}


def draw(law: dict, n: int, seed: int) -> list:
    rng = random.Random(seed)
    return rng.choices(list(law), weights=list(law.values()), k=n)


def test_samples_of_the_law_pass_and_of_another_law_fail():
    assert chi_square_p(draw(LAW, 4000, 1), LAW) > 1e-3
    other = {("a",): 0.4, ("b",): 0.4, ("c",): 0.19, ("d",): 0.01}
    assert chi_square_p(draw(other, 4000, 2), LAW) < 1e-6


def test_samples_outside_the_support_fail():
    law = {("a",): 0.5, ("b",): 0.5}
    assert chi_square_p(draw(law, 200, 3) + [("z",)], law) == 0.0
    # the rare cell (d: 40 expected of 4000 here) is its own cell; below 5 expected it is pooled
    assert chi_square_p(draw(LAW, 300, 4), LAW) > 1e-3
