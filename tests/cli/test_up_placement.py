"""Where `up` puts a verifier that shares the drafter's cores, and how many threads its passes run.

By default every pass runs on all the shared cores, beside a drafter call too: switching to fewer
threads around each drafter call left most served starts ~25 % slower on every pass
(bench/RESULTS.md, "Inference mode"). --verifier-threads N still asks for N threads beside one.
"""

from __future__ import annotations

from specdec.cli.up import shared_core_widths


def test_by_default_a_pass_beside_the_drafter_keeps_every_shared_core():
    cores, threads, beside = shared_core_widths([1], [0], None)
    assert cores == [0, 1]
    assert threads == beside == 2  # the width never switches


def test_verifier_threads_asks_for_the_narrower_pass_beside_a_drafter_call():
    cores, threads, beside = shared_core_widths([2, 3], [0, 1], 1)
    assert cores == [0, 1, 2, 3]
    assert (threads, beside) == (4, 1)


def test_overlapping_cores_are_counted_once():
    assert shared_core_widths([0, 1], [1], None) == ([0, 1], 2, 2)
