"""Several verifier replicas behind one name (orchestrator.clients.replicas): real gRPC servers on
loopback, the name resolved by a stand-in for DNS. Each request's sessions stay on one replica,
requests spread over the replicas, outputs equal a single verifier's, and a replica that goes
away mid-request costs a context resend, not the request."""

from __future__ import annotations

import os
from dataclasses import replace

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402

from drafter_service.server import start_drafter_server  # noqa: E402
from orchestrator.clients.grpc_client import GrpcDrafterClient, GrpcVerifierClient  # noqa: E402
from orchestrator.clients.replicas import (  # noqa: E402
    ReplicatedVerifierClient,
    engine_client,
    rendezvous,
    resolve_all,
    session_key,
)
from orchestrator.config import OrchestratorConfig  # noqa: E402
from orchestrator.speculation import Orchestrator  # noqa: E402
from specdec.engine.drafter import DrafterEngine  # noqa: E402
from specdec.engine.verifier import VerifierEngine  # noqa: E402
from specdec.generation import GenerationRequest  # noqa: E402
from specdec.rpc.grpc_support import stop_server  # noqa: E402
from specdec.runtime.loading import load_model  # noqa: E402
from specdec.runtime.tiny import save_tiny_model  # noqa: E402
from verifier_service.server import start_verifier_server  # noqa: E402

pytestmark = pytest.mark.timeout(300)

VOCAB = 8
NAME = "verifier.replicas.test:50052"


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("replica-tiny")
    return (load_model(save_tiny_model(root / "draft", vocab_size=VOCAB, seed=31), threads=1),
            load_model(save_tiny_model(root / "target", vocab_size=VOCAB, seed=32), threads=1))


def test_rendezvous_is_stable_and_moves_only_the_keys_of_a_gone_endpoint() -> None:
    endpoints = ["10.0.0.1:1", "10.0.0.2:1", "10.0.0.3:1"]
    keys = [f"req{i}/abcd" for i in range(300)]
    picks = {k: rendezvous(k, endpoints) for k in keys}
    assert set(picks.values()) == set(endpoints)  # all used
    assert picks == {k: rendezvous(k, list(reversed(endpoints))) for k in keys}  # order does not matter
    after = {k: rendezvous(k, endpoints[:2]) for k in keys}
    moved = {k for k in keys if after[k] != picks[k]}
    assert moved == {k for k in keys if picks[k] == endpoints[2]}
    assert session_key("r1/ab12~2") == session_key("r1/ab12") == "r1/ab12"


async def test_resolve_all_lists_the_addresses_of_a_name() -> None:
    found = await resolve_all("localhost", 50052)
    assert found and all(e.endswith(":50052") for e in found)
    assert "127.0.0.1:50052" in found or "[::1]:50052" in found


class Cluster:
    """A drafter and two verifier replicas (each its own engine on the same weights) on loopback."""

    def __init__(self, models) -> None:
        self.draft_model, self.target_model = models
        self.servers: dict[str, object] = {}
        self.engines: dict[str, VerifierEngine] = {}
        self.names: dict[str, str] = {}  # address → server name

    async def start(self) -> None:
        server, port = await start_drafter_server(DrafterEngine(self.draft_model), "127.0.0.1", 0)
        self.servers["drafter"], self.drafter = server, f"127.0.0.1:{port}"
        for name in ("a", "b"):
            engine = VerifierEngine(self.target_model)
            server, port = await start_verifier_server(engine, "127.0.0.1", 0)
            self.servers[name], self.engines[f"127.0.0.1:{port}"] = server, engine
            self.names[f"127.0.0.1:{port}"] = name
        self.alive = list(self.engines)

    async def resolve(self, host: str, port: int) -> list[str]:
        assert (host, port) == ("verifier.replicas.test", 50052)
        return list(self.alive)

    def orchestrator(self, verifier=None) -> Orchestrator:
        verifier = verifier or engine_client("verifier", NAME, resolve=self.resolve, refresh_s=0.0)
        return Orchestrator(GrpcDrafterClient(self.drafter), verifier,
                            OrchestratorConfig(pipeline=False, adaptive_k=False))

    def created(self) -> dict[str, int]:
        return {address: engine.sessions.stats()["created"] for address, engine in self.engines.items()}

    async def stop(self) -> None:
        for server in self.servers.values():
            await stop_server(server, 0.2)


@pytest.fixture
async def cluster(models):
    cluster = Cluster(models)
    await cluster.start()
    try:
        yield cluster
    finally:
        await cluster.stop()


def _request(i: int) -> GenerationRequest:
    return GenerationRequest(prompt_ids=[1 + i % 5, 2], max_new_tokens=12, seed=100 + i, method="token", k=3,
                             stop_token_ids=[], request_id=f"replica-test-{i}")


async def test_requests_spread_over_replicas_and_each_stays_on_one(cluster) -> None:
    replicated = cluster.orchestrator()
    assert isinstance(replicated.verifier, ReplicatedVerifierClient)
    single = cluster.orchestrator(GrpcVerifierClient(next(iter(cluster.engines))))
    try:
        before = cluster.created()
        results = []
        # Sessions land by rendezvous hashing of a random session id: 8 requests all fall on one of two
        # replicas once in 128 runs, so go on (up to 24, 2^-23 odds) until both have served some.
        for i in range(24):
            results.append(await replicated.generate(_request(i)))
            created = {a: n - before[a] for a, n in cluster.created().items()}
            if i >= 7 and all(n > 0 for n in created.values()):
                break
        assert sum(created.values()) == len(results)  # one session per request: never split over two
        assert all(n > 0 for n in created.values()), created  # and both replicas served some
        references = [await single.generate(_request(i)) for i in range(len(results))]
        assert [r.token_ids for r in results] == [r.token_ids for r in references]
    finally:
        await replicated.close()
        await single.close()


async def test_a_replica_that_goes_away_costs_a_resend_not_the_request(cluster) -> None:
    orchestrator = cluster.orchestrator()
    survivor = None
    try:
        stream = orchestrator.generate_stream(_request(3))
        first = await anext(stream)
        home = next(a for a, e in cluster.engines.items() if e.sessions.stats()["active_sessions"] > 0)
        await stop_server(cluster.servers[cluster.names[home]], 0.0)  # the pod dies, and leaves DNS
        cluster.alive = [a for a in cluster.engines if a != home]
        chunks = [first] + [chunk async for chunk in stream]
        survivor = cluster.orchestrator(GrpcVerifierClient(cluster.alive[0]))
        expected = await survivor.generate(replace(_request(3), request_id="replica-test-reference"))
        assert chunks[-1].result.token_ids == expected.token_ids and len(expected.token_ids) == 12
        assert cluster.engines[cluster.alive[0]].sessions.stats()["created"] >= 2  # the resend, then ours
    finally:
        await orchestrator.close()
        if survivor is not None:
            await survivor.close()
