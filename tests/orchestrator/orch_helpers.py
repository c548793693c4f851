"""Helpers shared by the orchestrator tests: fault-injecting client wrappers and plain-forward
references (no KV cache, no engine) to compare the real code path with."""

from __future__ import annotations

import torch

from specdec.engine.api import PeerUnavailable
from specdec.races import race, race_winner
from specdec.sampling import SamplingParams, warp_logits

# ------------------------------------------------------------------------------------------------
# fault-injecting client wrappers


class FlakyDrafter:
    """Raises PeerUnavailable on the drafter calls (draft, lookahead) whose 0-based number is in
    `down_calls`."""

    def __init__(self, inner, down_calls: set[int]) -> None:
        self.inner = inner
        self.address = "flaky-drafter"
        self.down_calls = down_calls
        self.calls = 0
        self.refused = 0

    async def info(self):
        return await self.inner.info()

    def _maybe_down(self) -> None:
        number = self.calls
        self.calls += 1
        if number in self.down_calls:
            self.refused += 1
            raise PeerUnavailable(f"{self.address} is down (injected)")

    async def draft(self, request):
        self._maybe_down()
        return await self.inner.draft(request)

    async def lookahead(self, request):
        self._maybe_down()
        return await self.inner.lookahead(request)

    async def release(self, session_id):
        await self.inner.release(session_id)

    async def close(self):
        await self.inner.close()


class ForgetfulClient:
    """Releases the caller's session in the engine before every `every`-th call of `method`,
    so the call meets SessionGone and the orchestrator has to resend the context."""

    def __init__(self, inner, method: str, every: int) -> None:
        self.inner = inner
        self.address = f"forgetful-{inner.address}"
        self.method = method
        self.every = every
        self.calls = 0
        self.forgotten = 0

    def __getattr__(self, name):
        attr = getattr(self.inner, name)
        if name != self.method:
            return attr

        async def call(request):
            self.calls += 1
            if self.calls % self.every == 0:
                if self.inner.engine.release(request.session_id):
                    self.forgotten += 1
            return await attr(request)

        return call


# ------------------------------------------------------------------------------------------------
# plain-forward references (no KV cache, no engine)


def target_rows(model, prefix: list[int], sampling: SamplingParams) -> torch.Tensor:
    """Warped next-token rows after every prefix position of `prefix` (one plain forward)."""
    with torch.no_grad():
        logits = model(torch.tensor([prefix])).logits[0].float()
    return warp_logits(logits, sampling)


def race_reference(model, prompt: list[int], n: int, seed: int, sampling: SamplingParams) -> list[int]:
    """Target-only decoding that emits argmin e_pos/P_pos at every position (ALGORITHMS.md §4)."""
    seq = list(prompt)
    for _ in range(n):
        row = target_rows(model, seq, sampling)[-1]
        seq.append(race_winner(race(seed, len(seq), row.shape[-1]), row))
    return seq[len(prompt):]


def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    """Hugging Face generate, greedy, EOS disabled (the plain target the cache must reproduce)."""
    from transformers import GenerationConfig

    config = GenerationConfig(do_sample=False, max_new_tokens=n, eos_token_id=[], pad_token_id=0)
    ids = torch.tensor([prompt])
    with torch.no_grad():
        # An explicit mask: otherwise generate treats prompt tokens equal to pad_token_id (0) as padding.
        out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config)
    return out[0, len(prompt):].tolist()
