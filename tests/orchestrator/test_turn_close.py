"""The close of a chat turn (orchestrator.turn_close): what a session lacks of the conversation as the
next turn resends it, and, through the loop at int8 with the prefix cache, that the next turn then
finds everything but its new message cached, samples the very tokens it would without the close or
without any cache, and that no close runs while another request holds a slot."""

from __future__ import annotations

import pytest

from orchestrator.clients.inprocess import InProcessDrafterClient, InProcessVerifierClient
from orchestrator.config import OrchestratorConfig
from orchestrator.speculation import Orchestrator
from orchestrator.turn_close import MAX_TURN_CLOSE_TOKENS, TurnClose, turn_close
from specdec.engine.drafter import DrafterEngine
from specdec.engine.verifier import VerifierEngine
from specdec.generation import ChatMessage, GenerationRequest
from specdec.runtime.prefix_cache import PrefixStore
from specdec.sampling import SamplingParams
from specdec.trees import common_prefix
from tests.orchestrator.helpers import load_int8_pair

VOCAB = 32
# Each turn: its role's word, its content, t4; the open assistant turn: the assistant's word, as in
# Qwen's template. The tiny tokenizer's EOS is t31, which a decoded answer leaves out (special), as
# Qwen's answer text leaves out its <|im_end|>.
TEMPLATE = ("{% for m in messages %}{% if m['role'] == 'user' %}t1 {% else %}t2 {% endif %}"
            "{{ m['content'] }} t4 {% endfor %}{% if add_generation_prompt %}t2{% endif %}")


def test_the_close_follows_the_answer():
    assert turn_close([1, 2, 3], [4, 5], [1, 2, 3, 4, 5, 9, 8]) == TurnClose(5, (9, 8))


def test_an_answer_the_client_got_shorter_is_cut_where_the_rendering_parts():
    # e.g. a stop string inside the last token, or an EOS the text leaves out
    assert turn_close([1, 2, 3], [4, 5, 6], [1, 2, 3, 4, 9]) == TurnClose(4, (9,))


def test_no_close_when_the_rendering_parts_from_the_prompt_adds_nothing_or_too_much():
    assert turn_close([1, 2, 3], [4], [1, 7, 3, 4, 9]) is None
    assert turn_close([1, 2, 3], [4, 5], [1, 2, 3, 4, 5]) is None
    assert turn_close([1, 2], [4], [1, 2, 4, *range(MAX_TURN_CLOSE_TOKENS + 1)]) is None
    assert turn_close([1, 2], [4], [1, 2, 4, *range(MAX_TURN_CLOSE_TOKENS)]) is not None


@pytest.fixture(scope="module")
def int8_pair(tmp_path_factory):
    return load_int8_pair(tmp_path_factory.mktemp("int8-pair"), VOCAB, (27, 28))


def build(pair, *, cached: bool = True, close: bool = True) -> tuple[Orchestrator, VerifierEngine]:
    draft, target = pair
    store = (lambda: PrefixStore(max_bytes=64 << 20, block_tokens=4)) if cached else (lambda: None)
    verifier = VerifierEngine(target, prefix_cache=store())
    config = OrchestratorConfig(pipeline=False, chat_template=TEMPLATE, close_chat_turns=close)
    return Orchestrator(InProcessDrafterClient(DrafterEngine(draft, prefix_cache=store())),
                        InProcessVerifierClient(verifier), config), verifier


def chat(messages: list[ChatMessage], seed: int) -> GenerationRequest:
    return GenerationRequest(messages=messages, max_new_tokens=10, sampling=SamplingParams(1.0), seed=seed,
                             method="token", k=3)


FIRST = [ChatMessage("user", "t5 t6 t7 t8 t9 t10 t11")]
NEXT = ChatMessage("user", "t12 t13 t14")


async def two_turns(orch: Orchestrator, *, busy: bool = False):
    """Turn 1, its answer, turn 2: (turn 1's result, turn 2's result, turn 2's prompt). `busy`: a slot is
    held while turn 1 ends, as by another request."""
    if busy:
        await orch.admission.acquire()
    first = await orch.generate(chat(FIRST, seed=5))
    await orch.settle_turn_closes()
    if busy:
        orch.admission.release()
    messages = [*FIRST, ChatMessage("assistant", first.text), NEXT]
    second = await orch.generate(chat(messages, seed=6))
    prompt = await orch.verifier.apply_chat_template(messages, TEMPLATE)
    return first, second, prompt


async def test_the_next_turn_finds_all_but_its_new_message_cached_and_samples_the_same(int8_pair):
    closing, verifier = build(int8_pair)
    plain, _ = build(int8_pair, close=False)
    uncached, _ = build(int8_pair, cached=False)
    try:
        first, second, prompt = await two_turns(closing)
        _, second_plain, _ = await two_turns(plain)
        _, second_uncached, _ = await two_turns(uncached)
        # What the close left cached: the conversation up to the new message (the open assistant turn's
        # t2 at the end of the rendering is cached too, but the next prompt goes on with t1 there).
        rendered = await closing.verifier.apply_chat_template([*FIRST, ChatMessage("assistant", first.text)],
                                                              TEMPLATE)
        new_message = len(prompt) - common_prefix(prompt, rendered)
        assert new_message == 6, (prompt, rendered)  # t1 t12 t13 t14 t4, then the open turn's t2
        assert second.stats.cached_tokens == len(prompt) - new_message, (second.stats, prompt)
        # Without the close, the template's t4 is not cached (nor the answer's last token, unless the
        # last verify took in a draft past the length limit, as here).
        assert second_plain.stats.cached_tokens < second.stats.cached_tokens
        assert second.token_ids == second_plain.token_ids == second_uncached.token_ids
        assert second_uncached.stats.cached_tokens == 0
        assert verifier.stats()["prefix_cache_hits"] >= 1
    finally:
        for orch in (closing, plain, uncached):
            await orch.close()


async def test_no_close_runs_while_another_request_holds_a_slot(int8_pair):
    closing, _ = build(int8_pair)
    plain, _ = build(int8_pair, close=False)
    try:
        _, busy, _ = await two_turns(closing, busy=True)
        _, second_plain, _ = await two_turns(plain)
        assert busy.stats.cached_tokens == second_plain.stats.cached_tokens > 0
        assert busy.token_ids == second_plain.token_ids
    finally:
        await closing.close()
        await plain.close()
