"""The pass-time line (specdec.runtime.pass_time): fitted from passes of different widths, kept
while later passes are alike, following a drift, never a negative cost."""

from __future__ import annotations

import pytest

from specdec.runtime.pass_time import MIN_SPREAD, PassTimeModel


def test_passes_of_two_widths_give_the_fixed_cost_and_a_rows_cost():
    """Passes of 10 and 60 rows on a line of 50 ms + 4 ms a row, with ±1 ms of noise: the fit is
    within a millisecond and a tenth of a millisecond a row."""
    model = PassTimeModel()
    for i in range(40):
        rows = 10 if i % 2 else 60
        model.add(rows, 0.050 + 0.004 * rows + (0.001 if i % 4 < 2 else -0.001))
    assert model.fitted
    assert model.fixed == pytest.approx(0.050, abs=1e-3)
    assert model.per_row == pytest.approx(0.004, abs=1e-4)
    assert model.seconds(30) == pytest.approx(0.170, abs=2e-3)


def test_passes_of_one_width_fit_nothing_and_keep_the_last_line():
    """Widths that differ by less than MIN_SPREAD say nothing about a row's cost: no line at first;
    once fitted, a long run of alike passes (whatever their times) keeps it."""
    model = PassTimeModel()
    for _ in range(50):
        model.add(20, 0.2)
        model.add(20 + int(MIN_SPREAD), 0.3)  # a spread of MIN_SPREAD / 2: too alike
    assert not model.fitted and model.seconds(10) is None
    model.add(400, 2.0)
    assert model.fitted
    for _ in range(300):  # on the line while the wide pass decays away
        model.add(33, model.seconds(33))
    line = (model.fixed, model.per_row)
    for _ in range(50):
        model.add(33, 5.0)  # alike passes say nothing about a row's cost, whatever they took
    assert (model.fixed, model.per_row) == line


def test_the_line_follows_a_drift_in_the_hosts_speed():
    """The same widths, then every pass 1.5× slower (a busier host): the newer passes decide."""
    model = PassTimeModel()
    for i in range(60):
        rows = 8 if i % 2 else 72
        model.add(rows, 0.05 + 0.004 * rows)
    for i in range(100):
        rows = 8 if i % 2 else 72
        model.add(rows, 1.5 * (0.05 + 0.004 * rows))
    assert model.per_row == pytest.approx(0.006, rel=0.02)
    assert model.fixed == pytest.approx(0.075, rel=0.05)


def test_a_slope_from_noise_below_zero_is_no_cost_and_the_fixed_cost_is_never_negative():
    """A flat pass (a GPU's) whose noise tilts the line down: rows cost 0 and the fixed cost is the
    mean; a line through a negative intercept keeps a fixed cost of 0."""
    flat = PassTimeModel()
    for i in range(30):
        flat.add(10 if i % 2 else 200, 0.0102 if i % 2 else 0.0100)
    assert flat.per_row == 0.0 and flat.fixed == pytest.approx(0.0101, abs=1e-4)
    steep = PassTimeModel()
    for i in range(30):
        rows = 20 if i % 2 else 100
        steep.add(rows, 0.01 * rows - 0.1)
    assert steep.per_row == pytest.approx(0.01) and steep.fixed == 0.0
