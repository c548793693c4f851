"""Drafting strategies: how a run drafts, one object per way, picked by the method's registry field
`Method.drafting` (specdec.methods). A new way of drafting is one strategy plus one entry in
STRATEGIES; the loop (orchestrator.speculation) only calls the DraftingStrategy Protocol.

  sequence  SequenceDrafts: k tokens (k fixed, or picked online); a tree when the run has a budget
  tree      TreeDrafts: a tree within the node budget
  coins     CoinDrafts: RD's coins fix each iteration's length
  none      TargetOnly: never drafts
Pipelinable methods run under LookAhead, which pre-drafts the next block during verification.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from orchestrator.adaptation import OPENING, PREDRAFTED_OPENING, DraftLength, PairEstimates
from orchestrator.config import OrchestratorConfig
from orchestrator.drafting.base import DraftingStrategy, TargetOnly
from orchestrator.drafting.coins import CoinDrafts
from orchestrator.drafting.fresh import SequenceDrafts, TreeDrafts
from orchestrator.drafting.lookahead import LookAhead, Pipelinable
from orchestrator.run import Run


@dataclass(frozen=True)
class DraftingContext:
    """What a strategy may take from the orchestrator when its run starts."""

    config: OrchestratorConfig  # the model pair's configuration
    estimates: Callable[[], PairEstimates]  # the model pair's estimates for the run's method (adaptation)


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


def strategy_for(run: Run, context: DraftingContext) -> DraftingStrategy:
    """The run's drafting strategy, by its method's `drafting` field."""
    name = run.settings.spec.drafting
    factory = STRATEGIES.get(name)
    if factory is None:
        raise ValueError(f"method {run.settings.method!r} drafts by {name!r}, which no strategy implements; "
                         f"known: {', '.join(STRATEGIES)}")
    return factory(run, context)
