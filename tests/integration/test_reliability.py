"""kill -9 of each service while 8 clients generate, the abuse cases of issue 14, and a short soak:
bench.bench_reliability's own code on tiny models (its full runs give docs/reliability.md's figures).

One stack of real `specdec serve` processes and a real redis-server, shared by the tests of this
module in file order (abuse first: it leaves the services as they were; kill restarts them).
Time bounds here are generous (2 shared cores); the benchmark records the real figures.
"""

from __future__ import annotations

import asyncio
import shutil

import pytest

from bench import bench_reliability as br

# One worker of a parallel run starts the module's stack (tests/conftest.py, "Parallel runs").
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("integration/test_reliability.py")]


@pytest.fixture(scope="module")
def stack(tiny_models, tmp_path_factory):
    if shutil.which("redis-server") is None:
        pytest.fail("redis-server is not installed: the reliability tests need a real Redis")
    workdir = tmp_path_factory.mktemp("reliability")
    with br.redis_server(workdir) as url:
        # A short resume lease: Resume after the orchestrator's kill need not wait the default 10 s.
        # float32 and unbatched engines, as docs/reliability.md's figures were measured (seeded runs
        # are bit-reproducible so; at the batch-invariant int8 default they are too, §14).
        services = br.Stack(br.Models(tiny_models.draft, tiny_models.target), workdir, store_url=url,
                            env={"SPECDEC_RESUME_LEASE_SECONDS": "2"},
                            engine_args=["--no-batching", "--dtype", "float32"])
        try:
            services.start()
            yield services
        finally:
            services.stop()


def test_abuse_cases_fail_fast_with_their_status(stack) -> None:
    results = asyncio.run(br.run_abuse(stack, progress=lambda _: None))
    statuses = {case["name"]: case["status"] for case in results["cases"]}
    expected_invalid = ["20 MB text prompt", "50 MB text prompt", "8 MB request_id", "200,000 stop strings",
                        "malformed request bytes", "temperature 1e-46", "a with the token method"]
    for name in expected_invalid:
        assert statuses[name] in ("INVALID_ARGUMENT", "RESOURCE_EXHAUSTED"), (name, statuses[name])
    # The engines of this stack run without a token: their own caps refuse the oversized look-ahead.
    assert statuses["direct Lookahead(k=1000, 16 + 16 guesses) on the drafter"] == "INVALID_ARGUMENT"
    for case in results["cases"]:
        assert case["seconds"] < 10.0, case
        assert "Traceback" not in case["detail"]
        assert "127.0.0.1:" not in case["detail"] or case["name"].startswith(("direct", "Release")), case
        # Another client's small requests are not held up for long by any of them.
        if case["victim_max_s"] is not None:
            assert case["victim_max_s"] < 10 * results["victim_baseline_max_s"] + 5.0, case


def test_kill_each_service_while_eight_clients_generate(stack) -> None:
    settings = br.KillSettings(clients=8, max_new_tokens=160)
    results = asyncio.run(br.run_kill(stack, settings, progress=lambda _: None))
    drafter, verifier, orchestrator = results["drafter"], results["verifier"], results["orchestrator"]
    # drafter: every request completes, and equals the seeded target-only run wherever the same request
    # with the drafter alive does (engines unbatched here: passes are bit-reproducible)
    assert drafter["completed"] == 8, drafter
    assert drafter["differences_the_kill_added"] == 0, drafter
    assert drafter["equal_to_target_only"] >= 1, drafter
    # verifier: UNAVAILABLE (without its address), NOT_SERVING, then SERVING after its restart
    assert verifier["statuses"] == ["UNAVAILABLE"], verifier
    assert verifier["seconds_to_status"]["max"] < 5.0, verifier
    not_serving = verifier["seconds_to_not_serving"]
    assert not_serving is not None and not_serving < 5.0, verifier
    assert verifier["seconds_to_serving_after_restart"] is not None, verifier
    assert verifier["request_after_restart"] == "OK", verifier
    assert verifier["messages_with_the_verifier_address"] == 0, verifier
    # orchestrator: Resume after its restart completes every request, nothing lost, exact
    assert orchestrator["resumed_complete"] == 8, orchestrator
    assert orchestrator["received_tokens_are_a_prefix"] == 8, orchestrator
    assert orchestrator["equal_to_uninterrupted_run"] == 8, orchestrator
    assert orchestrator["tokens_received_before_kill"]["max"] < settings.max_new_tokens, (
        "the kill landed after the requests ended", orchestrator)


def test_short_soak_has_no_errors(stack) -> None:
    results = asyncio.run(br.run_soak(stack, clients=8, seconds=15.0, sample_seconds=5.0, max_new_tokens=16,
                                      progress=lambda _: None))
    assert results["errors"] == 0 and results["requests"] > 8, results
    assert set(results["rss_mb"]) == {"drafter", "verifier", "orchestrator"}


def test_slope_is_least_squares() -> None:
    assert br.slope_mb_per_minute([(0.0, 100.0), (60.0, 101.0), (120.0, 102.0)]) == pytest.approx(1.0)
    assert br.slope_mb_per_minute([(0.0, 5.0)]) == 0.0
