"""Drafts without a draft model: prompt lookup over the request's own tokens, and the suffix cache of
recent requests (specdec.model_free): one ModelFreeProposer per source.

Both run here, in the orchestrator, not in a drafter service: a proposal is a few dictionary
lookups over tokens the orchestrator already holds (0.07–0.3 ms here, bench/bench_model_free.py),
where a drafter call is a gRPC round trip (about a millisecond on loopback) plus a model pass, and
the suffix cache must see every request's tokens, which only the orchestrator does. A model-free
draft is deterministic (q one-hot at each node), so it goes to the verifier as tokens alone and the
method's rule for deterministic drafts decides (VerifyRequest.deterministic; docs/algorithms.md §15).

A new model-free source is one ModelFreeProposer subclass (its `source` name and `propose`) and one
entry in orchestrator.drafting.PROPOSERS (docs/algorithms.md §8 shows one).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

from orchestrator.config import OrchestratorConfig
from orchestrator.drafting.base import Draft, Plan, ProposerBase, Step
from specdec.defaults import DraftSource
from specdec.model_free import PromptLookup, Proposal, SuffixCache
from specdec.trees import DraftTree


@dataclass(frozen=True)
class Budget:
    """How big a proposal may be: nodes in all, and depth (what fits every context window)."""

    max_nodes: int
    max_depth: int


class ModelFreeProposer(ProposerBase):
    """A draft source without a draft model. Each iteration verifies its proposal, or takes a
    target-only step when it has none. Every method that takes model-free drafts verifies trees of
    them (draw-and-descend, ERSD), so a proposal's tree goes as it is. A subclass names its `source`
    and implements `propose`; `close` hands over what outlives the run."""

    source: str

    def __init__(self, *, max_nodes: int) -> None:
        self.max_nodes = max_nodes

    def propose(self, committed: list[int], budget: Budget) -> Proposal | None:
        """A draft after `committed` within `budget` (None: nothing worth proposing)."""
        raise NotImplementedError

    def offer(self, step: Step, max_nodes: int | None = None) -> Proposal | None:
        """This source's proposal for the step's prefix, within the context windows and the node budget
        (`max_nodes`; None: the configured cap, self.max_nodes)."""
        cap = step.depth_cap(step.position)
        nodes = self.max_nodes if max_nodes is None else max_nodes
        if cap <= 0 or nodes < 1:
            return None
        proposal = self.propose(step.committed, Budget(nodes, cap))
        if proposal is None or len(proposal) == 0:
            return None
        proposal = proposal.truncated(nodes)
        if proposal is None or proposal.depth() > cap:
            return None
        return proposal

    def plan(self, step: Step) -> Plan | None:
        return self.plan_for(step, self.offer(step))

    def plan_for(self, step: Step, proposal: Proposal | None) -> Plan | None:
        """The plan that verifies `proposal` (None: a target-only step); the proposal waits in the step."""
        step.proposal = proposal
        if proposal is None:
            return None
        return Plan(list(proposal.parents), len(proposal), step.params(), needs_drafter=False,
                    source=proposal.source)

    async def draft(self, step: Step, plan: Plan) -> Draft:
        proposal, step.proposal = step.proposal, None
        assert proposal is not None, "draft() follows a plan() that proposed"
        tree = DraftTree(tuple(proposal.tokens), tuple(proposal.parents))
        return Draft(tree, None, step.settings.method, plan.params, plan=plan, source=plan.source,
                     deterministic=True)


class LookupProposer(ModelFreeProposer):
    """n-grams of the request's own prompt and output (specdec.model_free.PromptLookup): a sequence."""

    source = DraftSource.LOOKUP

    def __init__(self, config: OrchestratorConfig) -> None:
        super().__init__(max_nodes=config.lookup_max_tokens)
        self.index = PromptLookup(min_ngram=min(config.lookup_min_ngram, config.lookup_max_ngram),
                                  max_ngram=config.lookup_max_ngram, max_tokens=config.lookup_max_tokens)

    def propose(self, committed: list[int], budget: Budget) -> Proposal | None:
        self.index.sync(committed)
        return self.index.propose(max_tokens=min(budget.max_nodes, budget.max_depth))


class SuffixProposer(ModelFreeProposer):
    """The request's tokens and a cache of recent requests (SuffixCache): a tree. The run's tokens
    enter `cache` when it closes, and `publish_to` too when the run drafts from a private cache."""

    source = DraftSource.SUFFIX

    def __init__(self, cache: SuffixCache, key: Hashable, prompt: Sequence[int], *, max_nodes: int,
                 publish_to: SuffixCache | None = None) -> None:
        super().__init__(max_nodes=max_nodes)
        self.cache, self.key, self.publish_to = cache, key, publish_to
        self.prompt = list(prompt)
        cache.start(key, prompt)

    def propose(self, committed: list[int], budget: Budget) -> Proposal | None:
        self.cache.sync(self.key, committed)
        return self.cache.propose(self.key, max_nodes=budget.max_nodes, max_depth=budget.max_depth)

    def close(self, committed: list[int]) -> None:
        self.cache.sync(self.key, committed)
        self.cache.finish(self.key)
        if self.publish_to is not None:
            self.publish_to.start(self.key, self.prompt)
            self.publish_to.sync(self.key, committed)
            self.publish_to.finish(self.key)
