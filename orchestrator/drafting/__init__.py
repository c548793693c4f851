"""Draft sources: one proposer per source (base.Proposer), built by name from PROPOSERS. The model
proposer's drafts take the shape of the run's method (SHAPES, by Method.drafting); where tokens come
from (PROPOSERS) is apart from how a method shapes them (SHAPES). The loop (orchestrator.speculation)
calls the Proposer Protocol only.

PROPOSERS (RunSettings.draft_source; the names are specdec.defaults.DraftSource):
  model     ModelProposer: the draft model in the method's shape, pre-drafting when the run pipelines
  lookup    LookupProposer: the request's own n-grams
  suffix    SuffixProposer: the request's tokens and the orchestrator's cache of recent requests
  hybrid    HybridChooser: per iteration a model-free proposer, the model proposer or a target-only step
SHAPES (Method.drafting):
  sequence  SequenceDrafts: k tokens (k fixed, or picked online); a tree when the run has a budget
  tree      TreeDrafts: a tree within the node budget
  coins     CoinDrafts: RD's coins fix each iteration's length
  none      NoDrafts: never drafts

A new model-free source is one ModelFreeProposer subclass in a file of its own and one PROPOSERS
entry (docs/algorithms.md §8 walks through one).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from orchestrator.adaptation import OPENING, PREDRAFTED_OPENING, DraftLength, PairEstimates, SourceEstimates
from orchestrator.config import OrchestratorConfig
from orchestrator.drafting.base import Proposer
from orchestrator.drafting.hybrid import HybridChooser
from orchestrator.drafting.model import ModelProposer
from orchestrator.drafting.model_free import LookupProposer, ModelFreeProposer, SuffixProposer
from orchestrator.drafting.shapes import CoinDrafts, NoDrafts, SequenceDrafts, Shape, TreeDrafts
from orchestrator.run import Run
from specdec.defaults import DraftSource
from specdec.model_free import SuffixCache


@dataclass(frozen=True)
class DraftingContext:
    """What a proposer may take from the orchestrator when its run starts."""

    config: OrchestratorConfig  # the model pair's configuration
    estimates: Callable[[], PairEstimates]  # the model pair's estimates for the run's method (adaptation)
    has_drafter: bool = True  # False: the deployment has no draft model (`up --drafter none`)
    suffix_cache: SuffixCache | None = None  # the orchestrator's cache of recent requests (suffix, hybrid)
    source_estimates: SourceEstimates | None = None  # what model-free drafts were worth (hybrid)
    active_requests: Callable[[], int] = lambda: 1  # requests running now (hybrid's load limit)


ProposerFactory = Callable[[Run, DraftingContext], Proposer]
ShapeFactory = Callable[[Run, DraftingContext], Shape]


def _sequence(run: Run, context: DraftingContext) -> Shape:
    settings, config = run.settings, context.config
    if settings.tree_budget is not None:  # ersd with a tree budget drafts trees
        return TreeDrafts(settings)
    chooser = None
    if settings.adaptive:
        opening = PREDRAFTED_OPENING if config.predrafted_only and settings.pipeline else OPENING
        chooser = DraftLength(context.estimates(), k_max=config.max_k, start_k=config.default_k,
                              probe_every=config.adaptive_probe_every, opening=opening)
    return SequenceDrafts(settings, estimates=context.estimates, chooser=chooser)


SHAPES: dict[str, ShapeFactory] = {
    "sequence": _sequence,
    "tree": lambda run, context: TreeDrafts(run.settings),
    "coins": lambda run, context: CoinDrafts(run.settings),
    "none": lambda run, context: NoDrafts(),
}


def _model(run: Run, context: DraftingContext) -> ModelProposer:
    """The draft model in the shape of the run's method (its `drafting` field); with the drafter away
    or absent, its plans fall back to target-only steps (IterationRecord.fallback)."""
    settings = run.settings
    name = settings.spec.drafting
    factory = SHAPES.get(name)
    if factory is None:
        raise ValueError(f"method {settings.method!r} drafts by {name!r}, which no shape implements; "
                         f"known: {', '.join(SHAPES)}")
    shape = factory(run, context)
    return ModelProposer(shape, settings, pipelined=settings.pipeline and settings.spec.pipelinable,
                         predrafted_only=context.config.predrafted_only,
                         rejection_guesses=shape.rejection_guesses)


def _lookup(run: Run, context: DraftingContext) -> LookupProposer:
    return LookupProposer(context.config)


def _suffix(run: Run, context: DraftingContext) -> SuffixProposer:
    """The shared cache of recent requests, except for a run whose random streams another request may
    have used: a seeded request (requests with one seed share streams keyed on the position) or a
    resumed one (its earlier run had its seed). Another request's continuation from such streams
    would tell the draft what the verifier is about to draw (docs/algorithms.md §15); those runs
    draft from their own tokens only. Their tokens still join the cache: a reader with its own
    random seed draws independently of them."""
    shared, max_nodes = context.suffix_cache, context.config.suffix_max_nodes
    if shared is not None and not run.settings.seeded and not run.state.generated:
        return SuffixProposer(shared, run.session_id, run.settings.prompt_ids, max_nodes=max_nodes)
    own = SuffixCache(max_requests=0, max_tokens=0, max_depth=max_nodes)  # the run's own tokens only
    return SuffixProposer(own, run.session_id, run.settings.prompt_ids, max_nodes=max_nodes,
                          publish_to=shared)


def _hybrid(run: Run, context: DraftingContext) -> HybridChooser:
    """Model-free or model per iteration. A seeded request asks for replay: its model-free side is its
    own n-grams (lookup) and its choice reads no timings (hybrid module docstring)."""
    seeded = run.settings.seeded
    free: list[ModelFreeProposer] = [_lookup(run, context) if seeded else _suffix(run, context)]
    model = _model(run, context) if context.has_drafter else None
    estimates = context.source_estimates if context.source_estimates is not None else SourceEstimates()
    sampled = run.settings.sampling.temperature > 0
    return HybridChooser(free, model, estimates, timed=not seeded, sampled=sampled,
                         busy=draft_model_busy(context, seeded), requests_running=context.active_requests,
                         max_nodes=context.config.model_free_max_nodes)


def draft_model_busy(context: DraftingContext, seeded: bool) -> Callable[[], bool] | None:
    """The hybrid's load test: more requests running than config.draft_model_max_requests; None when
    there is no limit, or for a seeded request (its replay reads no other request)."""
    limit = context.config.draft_model_max_requests
    if not limit or seeded:
        return None
    return lambda: context.active_requests() > limit


PROPOSERS: dict[str, ProposerFactory] = {
    DraftSource.MODEL: _model,
    DraftSource.LOOKUP: _lookup,
    DraftSource.SUFFIX: _suffix,
    DraftSource.HYBRID: _hybrid,
}


def proposer_for(run: Run, context: DraftingContext) -> Proposer:
    """The run's proposer, by its draft source."""
    source = run.settings.draft_source
    factory = PROPOSERS.get(source)
    if factory is None:
        raise ValueError(f"draft source {source!r} is not one of {', '.join(PROPOSERS)}")
    return factory(run, context)
