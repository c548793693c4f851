"""Drafting strategies: how a run drafts, one object per way. Two registries: SOURCES, by the run's
draft source (where drafts come from), and STRATEGIES, by the method's `Method.drafting` (how the
draft model drafts for it). A new way of drafting is one strategy plus one entry; the loop
(orchestrator.speculation) only calls the DraftingStrategy Protocol.

SOURCES (RunSettings.draft_source):
  model     the draft model, by the method's STRATEGIES entry
  lookup    ModelFreeDrafts over the request's own n-grams (model_free.LookupProposer)
  suffix    ModelFreeDrafts over the request's tokens and the cache of recent requests
  hybrid    HybridDrafts: per iteration model-free, model or target-only, whichever pays
STRATEGIES (Method.drafting):
  sequence  SequenceDrafts: k tokens (k fixed, or picked online); a tree when the run has a budget
  tree      TreeDrafts: a tree within the node budget
  coins     CoinDrafts: RD's coins fix each iteration's length
  none      TargetOnly: never drafts
Pipelinable methods run under LookAhead, which pre-drafts the next block during verification.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from orchestrator.adaptation import OPENING, PREDRAFTED_OPENING, DraftLength, PairEstimates, SourceEstimates
from orchestrator.config import OrchestratorConfig
from orchestrator.drafting.base import DraftingStrategy, TargetOnly
from orchestrator.drafting.coins import CoinDrafts
from orchestrator.drafting.fresh import SequenceDrafts, TreeDrafts
from orchestrator.drafting.hybrid import HybridDrafts
from orchestrator.drafting.lookahead import LookAhead, Pipelinable
from orchestrator.drafting.model_free import LookupProposer, ModelFreeDrafts, SuffixProposer
from orchestrator.run import Run
from specdec.model_free import SuffixCache


@dataclass(frozen=True)
class DraftingContext:
    """What a strategy may take from the orchestrator when its run starts."""

    config: OrchestratorConfig  # the model pair's configuration
    estimates: Callable[[], PairEstimates]  # the model pair's estimates for the run's method (adaptation)
    has_drafter: bool = True  # False: the deployment has no draft model (`up --drafter none`)
    suffix_cache: SuffixCache | None = None  # the orchestrator's cache of recent requests (suffix, hybrid)
    source_estimates: SourceEstimates | None = None  # what model-free drafts were worth (hybrid)


StrategyFactory = Callable[[Run, DraftingContext], DraftingStrategy]


def look_ahead_if_pipelined(strategy: Pipelinable, run: Run, context: DraftingContext, *,
                            rejection_guesses: bool = True) -> DraftingStrategy:
    """`strategy` under a LookAhead when the run pipelines and its method allows it."""
    settings = run.settings
    if not (settings.pipeline and settings.spec.pipelinable):
        return strategy
    return LookAhead(strategy, settings, run.state.stats, predrafted_only=context.config.predrafted_only,
                     rejection_guesses=rejection_guesses)


def _sequence(run: Run, context: DraftingContext) -> DraftingStrategy:
    settings, config = run.settings, context.config
    if settings.tree_budget is not None:  # ersd with a tree budget drafts trees
        return TreeDrafts(settings)
    chooser = None
    if settings.adaptive:
        opening = PREDRAFTED_OPENING if config.predrafted_only and settings.pipeline else OPENING
        chooser = DraftLength(context.estimates(), k_max=config.max_k, start_k=config.default_k,
                              probe_every=config.adaptive_probe_every, opening=opening)
    return look_ahead_if_pipelined(SequenceDrafts(settings, estimates=context.estimates, chooser=chooser),
                                   run, context)


def _coins(run: Run, context: DraftingContext) -> DraftingStrategy:
    # RD looks ahead only where its next coins give a full block, known for the bonus guess alone.
    return look_ahead_if_pipelined(CoinDrafts(run.settings), run, context, rejection_guesses=False)


STRATEGIES: dict[str, StrategyFactory] = {
    "sequence": _sequence,
    "tree": lambda run, context: TreeDrafts(run.settings),
    "coins": _coins,
    "none": lambda run, context: TargetOnly(),
}


def _model(run: Run, context: DraftingContext) -> DraftingStrategy:
    """The draft model's strategy for the run's method, by its `drafting` field (with the drafter away
    or absent, its plans fall back to target-only steps: IterationRecord.fallback)."""
    name = run.settings.spec.drafting
    factory = STRATEGIES.get(name)
    if factory is None:
        raise ValueError(f"method {run.settings.method!r} drafts by {name!r}, which no strategy implements; "
                         f"known: {', '.join(STRATEGIES)}")
    return factory(run, context)


def _lookup(run: Run, context: DraftingContext) -> ModelFreeDrafts:
    return ModelFreeDrafts(LookupProposer(context.config), max_nodes=context.config.lookup_max_tokens)


def _suffix(run: Run, context: DraftingContext) -> ModelFreeDrafts:
    """The shared cache of recent requests, except for a run whose random streams another request may
    have used: a seeded request (requests with one seed share streams keyed on the position) or a
    resumed one (its earlier run had its seed). Another request's continuation from such streams
    would tell the draft what the verifier is about to draw (docs/algorithms.md §15); those runs
    draft from their own tokens only. Their tokens still join the cache: a reader with its own
    random seed draws independently of them."""
    shared = context.suffix_cache
    if shared is not None and not run.settings.seeded and not run.state.generated:
        proposer = SuffixProposer(shared, run.session_id, run.settings.prompt_ids)
    else:
        proposer = SuffixProposer(_cache_of_one_run(context.config), run.session_id, run.settings.prompt_ids,
                                  publish_to=shared)
    return ModelFreeDrafts(proposer, max_nodes=context.config.suffix_max_nodes)


def _hybrid(run: Run, context: DraftingContext) -> DraftingStrategy:
    """Model-free or model per iteration. A seeded request asks for replay: its model-free side is its
    own n-grams (lookup) and its choice reads no timings (hybrid module docstring)."""
    seeded = run.settings.seeded
    free = _lookup(run, context) if seeded else _suffix(run, context)
    model = _model(run, context) if context.has_drafter else None
    estimates = context.source_estimates if context.source_estimates is not None else SourceEstimates()
    return HybridDrafts(free, model, estimates, timed=not seeded,
                        sampled=run.settings.sampling.temperature > 0)


def _cache_of_one_run(config: OrchestratorConfig) -> SuffixCache:
    """A suffix cache of the run's own tokens only (no requests cached)."""
    return SuffixCache(max_requests=0, max_tokens=0, max_depth=config.suffix_max_nodes)


SOURCES: dict[str, StrategyFactory] = {
    "model": _model,
    "lookup": _lookup,
    "suffix": _suffix,
    "hybrid": _hybrid,
}


def strategy_for(run: Run, context: DraftingContext) -> DraftingStrategy:
    """The run's drafting strategy, by its draft source (and, for the model, its method)."""
    source = run.settings.draft_source
    factory = SOURCES.get(source)
    if factory is None:
        raise ValueError(f"draft source {source!r} is not one of {', '.join(SOURCES)}")
    return factory(run, context)
