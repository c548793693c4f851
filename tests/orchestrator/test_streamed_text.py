"""The output's text through the real loop: decoded incrementally by the verifier with each verify,
never by a Decode call per iteration, and equal to the one-shot decode (special tokens skipped) at
every chunk boundary — on a byte-level tokenizer whose characters often span tokens."""

from __future__ import annotations

import pytest

from orchestrator.clients.inprocess import InProcessDrafterClient, InProcessVerifierClient
from orchestrator.config import OrchestratorConfig
from orchestrator.speculation import Orchestrator
from specdec.engine.drafter import DrafterEngine
from specdec.engine.verifier import VerifierEngine
from specdec.generation import GenerationRequest
from specdec.runtime.loading import load_model
from specdec.sampling import SamplingParams
from tests.bpe_helpers import save_byte_level_model

NEW_TOKENS = 512


class CountingVerifier(InProcessVerifierClient):
    """Counts the Decode calls the orchestrator makes."""

    decodes = 0

    async def decode(self, token_ids):
        self.decodes += 1
        return await super().decode(token_ids)


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    directory = save_byte_level_model(tmp_path_factory.mktemp("bpe") / "model", max_context=NEW_TOKENS + 64)
    return load_model(directory, threads=1)


def one_shot(loaded, ids: list[int]) -> str:
    return loaded.tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)


@pytest.mark.parametrize("method", ["token", "ersd"])
async def test_a_long_stream_makes_no_decode_call_and_is_the_one_shot_decode(loaded, method):
    verifier = CountingVerifier(VerifierEngine(loaded))
    orch = Orchestrator(InProcessDrafterClient(DrafterEngine(loaded)), verifier, OrchestratorConfig())
    prompt = loaded.tokenizer.encode("東京 café:", add_special_tokens=False)
    request = GenerationRequest(prompt_ids=prompt, max_new_tokens=NEW_TOKENS, sampling=SamplingParams(1.0),
                                seed=5, method=method, stop_token_ids=[])
    streamed, ids, result, partial_boundaries = "", [], None, 0
    async for chunk in orch.generate_stream(request):
        streamed += chunk.text
        ids += chunk.token_ids
        shown = one_shot(loaded, ids)
        if chunk.result is None:  # held back: only the unsettled end, which holds a partial character
            held = shown[len(streamed):]
            assert shown.startswith(streamed) and (not held or held.endswith("\ufffd")), (shown, streamed)
            assert len(held) <= 8, held
            partial_boundaries += bool(held)
        result = chunk.result or result
    assert result is not None and len(result.token_ids) == NEW_TOKENS
    assert streamed == result.text == one_shot(loaded, result.token_ids)
    assert verifier.decodes == 0
    assert partial_boundaries > 0, "no chunk ended inside a character: the test would miss that case"


async def test_the_end_of_sequence_token_is_no_text(loaded):
    """A run ended by EOS keeps the token among its ids but shows no text for it."""
    eos = loaded.tokenizer.convert_tokens_to_ids("<eos>")
    orch = Orchestrator(None, InProcessVerifierClient(VerifierEngine(loaded)), OrchestratorConfig())
    prompt = loaded.tokenizer.encode("the quick", add_special_tokens=False)
    for seed in range(100):  # bounded: EOS is one of ~320 tokens, so ~1 run in 5 ends with it
        result = await orch.generate(GenerationRequest(
            prompt_ids=prompt, max_new_tokens=64, sampling=SamplingParams(1.0), seed=seed,
            method="autoregressive"))
        if result.token_ids[-1] == eos:
            break
    else:
        pytest.fail("no run ended with EOS")
    assert result.finish_reason == "eos" and "<eos>" not in result.text
    assert result.text == one_shot(loaded, result.token_ids)
