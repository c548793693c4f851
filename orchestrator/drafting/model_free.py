"""Drafts without a draft model: prompt lookup over the request's own tokens, and the suffix cache of
recent requests (specdec.model_free). One strategy, ModelFreeDrafts, over one proposer per source.

Both run here, in the orchestrator, not in a drafter service: a proposal is a few dictionary
lookups over tokens the orchestrator already holds (0.07–0.3 ms here, bench/bench_model_free.py),
where a drafter call is a gRPC round trip (about a millisecond on loopback) plus a model pass, and
the suffix cache must see every request's tokens, which only the orchestrator does. A model-free
draft is deterministic (q one-hot at each node), so it goes to the verifier as tokens alone and the
method's rule for deterministic drafts decides (VerifyRequest.deterministic; docs/algorithms.md §15).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Protocol

from orchestrator.config import OrchestratorConfig
from orchestrator.drafting.base import Draft, Drafting, Plan, Step
from specdec.defaults import DraftSource
from specdec.model_free import PromptLookup, Proposal, SuffixCache
from specdec.trees import DraftTree


class Proposer(Protocol):
    """One model-free draft source, bound to one run."""

    source: str

    def propose(self, committed: list[int], *, max_nodes: int, max_depth: int) -> Proposal | None:
        """A draft after `committed` (None: nothing worth proposing)."""
        ...

    def close(self, committed: list[int]) -> None:
        """The run ended with `committed`."""
        ...


class LookupProposer:
    """n-grams of the request's own prompt and output (specdec.model_free.PromptLookup): a sequence."""

    source = DraftSource.LOOKUP

    def __init__(self, config: OrchestratorConfig) -> None:
        self.index = PromptLookup(min_ngram=min(config.lookup_min_ngram, config.lookup_max_ngram),
                                  max_ngram=config.lookup_max_ngram, max_tokens=config.lookup_max_tokens)

    def propose(self, committed: list[int], *, max_nodes: int, max_depth: int) -> Proposal | None:
        self.index.sync(committed)
        return self.index.propose(max_tokens=min(max_nodes, max_depth))

    def close(self, committed: list[int]) -> None:
        return None


class SuffixProposer:
    """The request's tokens and a cache of recent requests (SuffixCache): a tree. The run's tokens
    enter `cache` when it closes, and `publish_to` too when the run drafts from a private cache."""

    source = DraftSource.SUFFIX

    def __init__(self, cache: SuffixCache, key: Hashable, prompt: Sequence[int], *,
                 publish_to: SuffixCache | None = None) -> None:
        self.cache, self.key, self.publish_to = cache, key, publish_to
        self.prompt = list(prompt)
        cache.start(key, prompt)

    def propose(self, committed: list[int], *, max_nodes: int, max_depth: int) -> Proposal | None:
        self.cache.sync(self.key, committed)
        return self.cache.propose(self.key, max_nodes=max_nodes, max_depth=max_depth)

    def close(self, committed: list[int]) -> None:
        self.cache.sync(self.key, committed)
        self.cache.finish(self.key)
        if self.publish_to is not None:
            self.publish_to.start(self.key, self.prompt)
            self.publish_to.sync(self.key, committed)
            self.publish_to.finish(self.key)


class ModelFreeDrafts(Drafting):
    """Each iteration verifies the proposer's draft, or takes a target-only step when it has none.
    Every method that takes model-free drafts verifies trees of them (draw-and-descend, ERSD), so
    the suffix cache's trees go as they are."""

    def __init__(self, proposer: Proposer, *, max_nodes: int) -> None:
        self.proposer = proposer
        self.source = proposer.source
        self.max_nodes = max_nodes
        self._proposal: Proposal | None = None  # planned, not yet drafted

    def propose(self, step: Step) -> Proposal | None:
        """The proposer's draft for this prefix, within the context windows and the node budget."""
        cap = step.depth_cap(step.position)
        if cap <= 0:
            return None
        proposal = self.proposer.propose(step.committed, max_nodes=self.max_nodes, max_depth=cap)
        if proposal is None or len(proposal) == 0:
            return None
        proposal = proposal.truncated(self.max_nodes)
        if proposal is None or proposal.depth() > cap:
            return None
        return proposal

    def plan(self, step: Step) -> Plan | None:
        return self.plan_for(step, self.propose(step))

    def plan_for(self, step: Step, proposal: Proposal | None) -> Plan | None:
        """The plan that verifies `proposal` (None: a target-only step)."""
        self._proposal = proposal
        if proposal is None:
            return None
        return Plan(list(proposal.parents), len(proposal), step.params(), needs_drafter=False,
                    source=proposal.source)

    async def draft(self, step: Step, plan: Plan) -> Draft:
        proposal, self._proposal = self._proposal, None
        assert proposal is not None, "draft() follows a plan() that proposed"
        step.record.k = plan.k
        tree = DraftTree(tuple(proposal.tokens), tuple(proposal.parents))
        return Draft(tree, None, step.settings.method, plan.params, plan=plan, source=plan.source,
                     deterministic=True)

    def close(self, committed: list[int]) -> None:
        self.proposer.close(committed)
