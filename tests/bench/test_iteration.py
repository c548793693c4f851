"""bench.bench_iteration's span arithmetic on a hand-made trace (the real run needs the default pair)."""

from __future__ import annotations

import pytest

from bench.bench_iteration import breakdown

MS = 1_000_000


def span(span_id, parent, name, start_ms, end_ms, kind="INTERNAL", **attributes):
    return {
        "span_id": span_id,
        "parent_span_id": parent,
        "name": name,
        "kind": kind,
        "start_ns": start_ms * MS,
        "end_ns": end_ms * MS,
        "attributes": attributes,
    }


def test_one_iteration_split_along_its_nested_spans() -> None:
    spans = [
        span("r", None, "specdec.request", 0, 400, **{"specdec.request_id": "req"}),
        span("i", "r", "specdec.iteration", 0, 300, **{"specdec.emitted": 3}),
        # the loop's drafter call: 20 ms waiting before the RPC, the engine computes 100 of its 150
        span("d", "i", "specdec.draft", 0, 200),
        span("dc", "d", "/specdec.v1.DrafterService/Draft", 20, 200, kind="CLIENT"),
        span("ds", "dc", "/specdec.v1.DrafterService/Draft", 25, 195, kind="SERVER"),
        span("de", "ds", "drafter.draft", 30, 190),
        span("df", "de", "drafter.forward", 40, 140),
        # the verifier's call runs inside the iteration; a look-ahead outlives it (clipped)
        span("v", "i", "specdec.verify", 200, 300),
        span("vc", "v", "/specdec.v1.VerifierService/Verify", 201, 300, kind="CLIENT"),
        span("vs", "vc", "/specdec.v1.VerifierService/Verify", 205, 295, kind="SERVER"),
        span("ve", "vs", "verifier.verify", 210, 290),
        span("vf", "ve", "verifier.forward", 210, 270),
        span("vv", "ve", "verifier.verification", 270, 280),
        span("l", "i", "specdec.draft", 250, 350),
    ]
    result = breakdown(spans, {"req": 4})[4]
    draft = result["calls"]["Draft"]
    assert draft["compute"] == [pytest.approx(0.100)]
    assert draft["engine"] == [pytest.approx(0.060)]
    assert draft["handler"] == [pytest.approx(0.010)]
    assert draft["wire"] == [pytest.approx(0.010)]
    assert draft["loop"] == [pytest.approx(0.020)]
    verify = result["calls"]["Verify"]
    assert verify["compute"] == [pytest.approx(0.070)] and verify["engine"] == [pytest.approx(0.010)]
    iteration = result["iterations"]
    assert iteration["wall"] == [pytest.approx(0.300)]
    assert iteration["in a call"] == [pytest.approx(0.300)]  # the look-ahead is clipped at the end
    assert iteration["between calls"] == [pytest.approx(0.0)]
    assert iteration["tokens"] == [3]
