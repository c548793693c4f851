"""The prefix cache through the loop, at int8: a conversation's later turns start from the cached
earlier turns (prompt and answer), report them as cached_tokens, and give the very tokens of engines
without a cache, seeded sampling included; requests of another caller or another cache_salt find
nothing (the membership probe through the stats and through the work done)."""

from __future__ import annotations

import pytest

from orchestrator.clients.inprocess import InProcessDrafterClient, InProcessVerifierClient
from orchestrator.config import OrchestratorConfig
from orchestrator.speculation import Orchestrator
from specdec.engine.drafter import DrafterEngine
from specdec.engine.verifier import VerifierEngine
from specdec.errors import InvalidRequest
from specdec.generation import GenerationRequest
from specdec.runtime.prefix_cache import PrefixStore
from specdec.sampling import SamplingParams
from tests.orchestrator.helpers import load_int8_pair

VOCAB = 32
BLOCK = 4
KEEPS_DRAFT_SOURCE_DEFAULT = True  # the default hybrid: model drafts and model-free ones both go through


@pytest.fixture(scope="module")
def int8_pair(tmp_path_factory):
    return load_int8_pair(tmp_path_factory.mktemp("int8-pair"), VOCAB, (17, 18))


def orchestrator(pair, cached: bool) -> tuple[Orchestrator, VerifierEngine]:
    draft, target = pair
    store = (lambda: PrefixStore(max_bytes=64 << 20, block_tokens=BLOCK)) if cached else (lambda: None)
    verifier = VerifierEngine(target, prefix_cache=store())
    drafter = DrafterEngine(draft, prefix_cache=store())
    return Orchestrator(InProcessDrafterClient(drafter), InProcessVerifierClient(verifier),
                        OrchestratorConfig(pipeline=False)), verifier


def turn(prompt: list[int], seed: int, method: str, salt: str | None = None) -> GenerationRequest:
    return GenerationRequest(prompt_ids=prompt, max_new_tokens=12, sampling=SamplingParams(1.0), seed=seed,
                             method=method, k=3, stop_token_ids=[], cache_salt=salt)


async def conversation(orch: Orchestrator, method: str) -> list[tuple[list[int], int]]:
    """Three turns, each prompt the last prompt + its answer + a new message: (tokens, cached) each."""
    prompt, answers = [(3 * i + 1) % VOCAB for i in range(14)], []
    for index in range(3):
        result = await orch.generate(turn(prompt, seed=40 + index, method=method))
        answers.append((result.token_ids, result.stats.cached_tokens))
        prompt = prompt + result.token_ids + [(5 * i + index) % VOCAB for i in range(6)]
    return answers


@pytest.mark.parametrize("method", ["token", "ersd", "gsd-tree"])
async def test_later_turns_hit_the_cache_and_sample_the_same_tokens(int8_pair, method):
    cached, verifier = orchestrator(int8_pair, cached=True)
    plain, _ = orchestrator(int8_pair, cached=False)
    with_cache, without = await conversation(cached, method), await conversation(plain, method)
    await cached.close()
    await plain.close()
    assert [tokens for tokens, _ in with_cache] == [tokens for tokens, _ in without]
    assert with_cache[0][1] == 0 and all(hit > 0 for _, hit in with_cache[1:]), with_cache
    assert all(hit == 0 for _, hit in without)
    # The second turn's prompt is the first's + its answer + 6 tokens: all of it but the answer's last
    # token hits (no pass took that one in), the first session's last partial block included.
    first_prompt = 14 + len(with_cache[0][0])
    assert with_cache[1][1] >= first_prompt - 1, (with_cache, first_prompt)
    assert verifier.stats()["prefix_cache_hits"] >= 2


async def test_another_caller_or_salt_finds_nothing(int8_pair):
    """Membership probe: B sends A's prompt. Same caller and salt: cached tokens, and fewer tokens
    forwarded (a faster first token). Another caller, or another salt: what a cold cache gives."""
    secret = [(7 * i + 2) % VOCAB for i in range(29)]
    orch, verifier = orchestrator(int8_pair, cached=True)
    forwarded = lambda: verifier.stats()["batch_positions"]  # noqa: E731 - query positions the passes ran

    async def probe(owner: str, salt: str | None) -> tuple[int, int]:
        before = forwarded()
        result = await orch.generate(turn(secret, seed=1, method="autoregressive", salt=salt), owner=owner)
        return result.stats.cached_tokens, forwarded() - before

    await orch.generate(turn(secret, seed=0, method="autoregressive", salt="a"), owner="token:alice")
    same = await probe("token:alice", "a")
    other_salt = await probe("token:alice", "b")
    other_owner = await probe("token:bob", "a")
    await orch.close()
    assert same[0] == 28 and other_salt[0] == other_owner[0] == 0
    assert same[1] < other_salt[1] == other_owner[1]


@pytest.mark.parametrize("salt", ["", "x" * 257, "tab\there", 5])
async def test_a_bad_cache_salt_is_refused(int8_pair, salt):
    orch, _ = orchestrator(int8_pair, cached=True)
    with pytest.raises(InvalidRequest, match="cache_salt"):
        await orch.generate(turn([1, 2, 3], seed=0, method="token", salt=salt))  # type: ignore[arg-type]
    await orch.close()


async def test_the_suffix_cache_is_partitioned_like_the_prefix_cache(int8_pair):
    """A finished request's text is proposed to later requests of its caller and salt only."""
    from orchestrator.run import cache_partition

    orch, _ = orchestrator(int8_pair, cached=True)
    request = turn([(3 * i) % VOCAB for i in range(20)], seed=0, method="token", salt="a")
    request.draft_source, request.seed = "suffix", None
    await orch.generate(request, owner="token:alice")
    await orch.close()
    caches = orch.suffix_caches
    assert caches.of(cache_partition("token:alice", "a")).cached_requests == 1
    assert caches.of(cache_partition("token:alice", "b")).cached_requests == 0
    assert caches.of(cache_partition("token:bob", "a")).cached_requests == 0


def test_suffix_caches_keep_the_most_recent_partitions():
    from specdec.model_free import SuffixCaches

    caches = SuffixCaches(2, max_requests=4, max_tokens=64)
    first, second = caches.of("a"), caches.of("b")
    assert caches.of("a") is first  # touched: "b" is now the oldest
    caches.of("c")
    assert len(caches) == 2 and caches.of("a") is first
    assert caches.of("b") is not second  # dropped with the oldest partition, a new one now
