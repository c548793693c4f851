"""On greedy rows a descend rule (ERSD, draw-and-descend) is decided by each row's argmax alone
(verification.base.greedy_descent): the same VerifyResult as the rule on the warped one-hot rows,
ties and NaN rows included; and row_argmax is torch.argmax's answer."""

from __future__ import annotations

import random

import pytest
import torch

from specdec.methods import METHODS, get_method
from specdec.randomness import TorchRandomSource
from specdec.sampling import SamplingParams, row_argmax, warp_logits
from specdec.trees import DraftTree
from specdec.verification.base import MethodParams, greedy_descent
from specdec.verification.dispatch import verify

VOCAB = 12
GREEDY = SamplingParams(temperature=0.0)


def _logits(rows: int, rng: random.Random) -> torch.Tensor:
    """Rows on a coarse grid, so maxima are often tied; now and then a NaN or an all -inf row."""
    logits = torch.tensor([[float(rng.randint(0, 3)) for _ in range(VOCAB)] for _ in range(rows)])
    for row in range(rows):
        if rng.random() < 0.1:
            logits[row, rng.randrange(VOCAB)] = float("nan")
    return logits


def _tree_towards(logits: torch.Tensor, rng: random.Random) -> DraftTree:
    """A random tree whose nodes often carry their parent row's argmax (so paths get accepted)."""
    winners = torch.argmax(logits, dim=-1).tolist()
    tokens: list[int] = []
    parents: list[int] = []
    for i in range(logits.shape[0] - 1):
        parent = rng.randint(-1, i - 1)
        taken = {tokens[j] for j, p in enumerate(parents) if p == parent}
        wanted = winners[parent + 1] if rng.random() < 0.6 else rng.randrange(VOCAB)
        free = [t for t in range(VOCAB) if t not in taken]
        tokens.append(wanted if wanted in free else rng.choice(free))
        parents.append(parent)
    return DraftTree(tuple(tokens), tuple(parents))


DESCENDING = [(name, deterministic) for name, method in METHODS.items() for deterministic in (False, True)
              if method.speculative and method.descends(deterministic)]


def test_the_descend_rules_are_ersd_and_draw_and_descend():
    assert DESCENDING == [("token", True), ("block", True), ("ersd", False), ("ersd", True),
                          ("gsd-tree", True)]
    assert not get_method("token").descends(False)


@pytest.mark.parametrize(("method", "deterministic"), DESCENDING)
def test_greedy_descent_is_the_rule_on_greedy_rows(method, deterministic):
    rng = random.Random(f"greedy-{method}-{deterministic}")
    for case in range(150):
        logits = _logits(rng.randint(1, 9), rng)
        tree = _tree_towards(logits, rng)
        params = MethodParams(seed=case, position=case)
        source = TorchRandomSource.from_seed(case, "verify", case)
        rows = warp_logits(logits, GREEDY)
        expected = verify(method, tree, rows, None, params, source, deterministic=True) if deterministic \
            else verify(method, tree, rows, None, params, None)
        assert greedy_descent(tree, logits) == expected, (case, tree)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
def test_row_argmax_is_torch_argmax(dtype):
    rng = random.Random(str(dtype))
    for _ in range(50):
        logits = _logits(rng.randint(1, 6), rng).to(dtype)
        assert torch.equal(row_argmax(logits), torch.argmax(logits, dim=-1))
    wide = torch.randn(3, 151_936)
    assert torch.equal(row_argmax(wide), torch.argmax(wide, dim=-1))
    assert torch.equal(row_argmax(wide[:, ::2]), torch.argmax(wide[:, ::2], dim=-1))  # strided rows
