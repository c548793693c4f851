"""The method registry: one frozen record per generation method, read by every layer.

The CLI's choices, the orchestrator's validation, the scheduler, the pipeline, the verifier
engine, the benchmark and `specdec.verification.dispatch.verify` all ask this table what a
method needs, instead of comparing method names. Adding a method is one module under
`specdec/verification/` plus one entry here. The rules themselves are in docs/algorithms.md.

Glossary (the words the records use):
  draft rows        Q: the drafter's warped next-token distributions, one row per tree node plus
                    the root, shape [n + 1, V] (row layout: specdec.verification.base). They are
                    what crosses the network from drafter to verifier when a method needs them.
  target rows       P: the verifier's rows in the same layout; they never leave the verifier.
  random source     the seeded stream (specdec.randomness) a rejection rule draws its uniforms
                    and categorical samples from; ERSD needs none (it is driven by races).
  draft strategy    how the drafter picks tokens: "sample" draws them from Q (children of a
                    tree node without replacement); "race" takes the first arrivals of the
                    position's exponential race under Q (docs/algorithms.md §4).
  draft shape       "sequence": a path of k tokens; "tree": a tree within a node budget.
  pipelinable       a sequence block can be pre-drafted while the verifier checks the one before
                    (orchestrator.drafting.model; exact by construction, docs/algorithms.md §8).
  adaptive length   a pipelined pre-draft may keep growing, one token per drafter call, until the
                    verifier answers (`pipeline_max_k`). Exact only when the rule's decision at
                    position i reads the drafts up to i alone (token; ERSD's races): a grown
                    pre-draft draws x̃_{j+1} from the drafter stream keyed on its context length,
                    and block verification's τ also reads later drafts, so after τ = a the next
                    fresh draft would reuse the stream that drew x̃_{a+2}, whose uniform is no
                    longer uniform given τ = a (docs/algorithms.md §8). Block and RD pipeline
                    fixed-length blocks.
  drafting          how an iteration drafts, the name of one drafting strategy
                    (orchestrator.drafting): "sequence" (a path of k tokens, or a tree when a
                    budget is asked for and the method drafts trees), "tree" (a tree within a
                    node budget: the request's k is that budget), "coins" (randomised drafting:
                    per-position Bernoulli(a) coins fix how many tokens an iteration drafts, K,
                    so the draft length is not the orchestrator's to choose), "none" (target only).
  empty-draft rows  an iteration with no draft token still needs Q_1 (RD's no-draft step emits
                    from norm((P_1 − a·Q_1)+)); for the others an empty tree samples P_1 alone.
  deterministic     a model-free draft (prompt lookup, suffix cache; orchestrator.drafting): each
                    node's q is one-hot at its token, so no rows cross the wire and the method's
                    `deterministic_rule` decides (docs/algorithms.md §15): ERSD's own rule; for
                    token and block the draw-and-descend rule, their law under one-hot q, which
                    accepts the most an exact rule can; gsd-tree's trees of distinct candidates
                    go to draw-and-descend too (its one draft row per node cannot be one-hot at
                    several children). RD has none (its coins are for a draft model; refused).
  lean rows         the draft rows may go to the verifier lean (docs/algorithms.md §12): each
                    node's q(x̃) alone, and a whole row only when the rule reaches it (the
                    verifier answers draft_rows_needed and the verify is resent with them).
                    Derived from what each rule reads: token and rd read q at the drafted tokens
                    and one row at the first rejection (rd also row K on tails: sent up front,
                    `rows_up_front`); gsd-tree a node's row only once one of its children is
                    rejected. Not block: its pass probabilities read Σ(w·P − Q)+ over every row
                    1..live, so a lean verify would fetch them all a round trip later. ERSD reads
                    no draft row at all.
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from typing import TYPE_CHECKING, Any, Literal

from specdec.verification.errors import VerificationError

if TYPE_CHECKING:  # the rules need torch; the table itself stays importable without it
    from specdec.verification.base import MethodParams, VerifyResult

VerifyFn = Callable[..., "VerifyResult"]  # (tree, target Rows, draft Rows | None, params, source)
DraftStrategy = Literal["sample", "race"]
DraftShape = Literal["sequence", "tree"]

# The method a target-only step runs: race sampling keyed on (seed, position), so a seeded
# autoregressive run and a seeded ERSD run emit the same tokens (docs/algorithms.md §4).
TARGET_ONLY_VERIFICATION = "ersd"
AUTOREGRESSIVE = "autoregressive"  # the target-only method (what an IterationRecord of such a step names)
# The exact rule for a model-free tree or sequence under token, block and gsd-tree (glossary).
DRAW_AND_DESCEND = "specdec.verification.deterministic:verify_deterministic"
ERSD_RULE = "specdec.verification.ersd:verify_ersd"
# Rules that walk the tree from the root drawing one token per row from the target alone
# (verification.base.descend): on greedy rows each draw is the row's argmax, so they emit the greedy
# descent (verification.base.greedy_descent).
DESCEND_RULES = frozenset({DRAW_AND_DESCEND, ERSD_RULE})


@dataclass(frozen=True)
class Method:
    """What one generation method needs from each layer (see the glossary above)."""

    name: str
    summary: str
    rule: str | None  # "module:function" of its verification rule; None: target-only decoding
    needs_draft_rows: bool = False
    needs_random_source: bool = False
    draft_strategy: DraftStrategy | None = None
    draft_shapes: frozenset[DraftShape] = frozenset()  # ersd: a tree only when a budget is asked for
    pipelinable: bool = False  # its sequence iterations can be pre-drafted during verification
    adaptive_length: bool = False  # its pre-drafts may grow until the verifier answers (glossary)
    drafting: str = "none"  # the drafting strategy's name (glossary; orchestrator.drafting.STRATEGIES)
    empty_draft_needs_rows: bool = False
    lean_rows: bool = False  # its draft rows go lean by default: q per node, rows on demand (glossary)
    deterministic_rule: str | None = None  # "module:function" deciding a model-free draft (glossary)

    @property
    def speculative(self) -> bool:
        """Whether the method drafts at all (False only for target-only decoding)."""
        return self.rule is not None

    @property
    def verify(self) -> VerifyFn:
        """The verification rule (imported on first use: it needs torch)."""
        if self.rule is None:
            raise VerificationError(f"method {self.name!r} verifies no drafts")
        return _resolve(self.rule)

    @property
    def takes_deterministic_drafts(self) -> bool:
        """Whether a model-free draft (one-hot q) has an exact rule under this method."""
        return self.deterministic_rule is not None

    @property
    def verify_deterministic(self) -> VerifyFn:
        """The rule for a model-free draft (imported on first use: it needs torch)."""
        if self.deterministic_rule is None:
            raise VerificationError(
                f"method {self.name!r} has no exact rule for model-free (deterministic) drafts; use one of "
                f"{', '.join(DETERMINISTIC_METHOD_NAMES)}"
            )
        return _resolve(self.deterministic_rule)

    def descends(self, deterministic: bool) -> bool:
        """Whether the rule deciding a draft (a model-free one when `deterministic`) is a descend walk
        over the target's rows alone (DESCEND_RULES)."""
        return (self.deterministic_rule if deterministic else self.rule) in DESCEND_RULES

    @property
    def takes_a(self) -> bool:
        """Whether requests give this method a drafting probability `a` (its coins use it)."""
        return self.drafting == "coins"

    @property
    def k_is_tree_budget(self) -> bool:
        """Whether the request's k is this method's node budget (it drafts trees only)."""
        return self.drafting == "tree"

    @property
    def drafts_trees(self) -> bool:
        return "tree" in self.draft_shapes

    @property
    def drafts_sequences(self) -> bool:
        return "sequence" in self.draft_shapes

    def needs_rows(self, params: MethodParams, num_drafted: int) -> bool:
        """Whether a verification of `num_drafted` tokens with `params` reads draft rows.

        False for ERSD, for RD with a = 0 (it never drafts), and for an empty tree of a method
        whose empty step samples the target's row alone.
        """
        if not self.needs_draft_rows:
            return False
        if self.takes_a:
            check_drafting_probability(params.a)
            if params.a == 0.0:
                return False
        return num_drafted > 0 or self.empty_draft_needs_rows

    def rows_up_front(self, params: MethodParams, num_drafted: int) -> tuple[int, ...]:
        """The draft rows a lean verify carries from the start (docs/algorithms.md §12).

        RD with K = num_drafted < k_max reads exactly one draft row whatever happens — the first
        rejected row, or the tails row K when all K drafts pass (always for K = 0) — so row K goes
        along and only a rejection costs a second round trip. Every other lean rule reads rows
        only on a rejection: none up front.
        """
        if self.takes_a and num_drafted < params.k_max and self.needs_rows(params, num_drafted):
            return (num_drafted,)
        return ()


def _rejection_method(name: str, summary: str, drafting: str, **fields: Any) -> Method:
    """A method that samples its drafts from Q and verifies them by rejection against Q's rows.

    Token, block, gsd-tree and RD share these needs, their rule's place (`verify_<name>` in
    `specdec.verification.<name>`) and a draft shape that follows from their drafting; one
    constructor keeps the table from restating (and drifting on) them per entry.
    """
    module = name.replace("-", "_")
    shape: DraftShape = "tree" if drafting == "tree" else "sequence"
    return Method(
        name=name,
        summary=summary,
        rule=f"specdec.verification.{module}:verify_{module}",
        needs_draft_rows=True,
        needs_random_source=True,
        draft_strategy="sample",
        draft_shapes=frozenset({shape}),
        drafting=drafting,
        **fields,
    )


METHODS: dict[str, Method] = {
    method.name: method
    for method in (
        _rejection_method(
            "token",
            "Leviathan/Chen token verification: accept x̃ with min(1, P/Q), residual norm((P − Q)+)",
            drafting="sequence",
            pipelinable=True, adaptive_length=True, lean_rows=True, deterministic_rule=DRAW_AND_DESCEND,
        ),
        _rejection_method(
            "block",
            "Sun et al. block verification: judges the block jointly; never fewer tokens than token",
            drafting="sequence",
            pipelinable=True, deterministic_rule=DRAW_AND_DESCEND,
        ),
        Method(
            name="ersd",
            summary="exponential races keyed on (seed, position): output is target race sampling, "
            "no draft rows on the wire; sequence or tree",
            rule=ERSD_RULE,
            draft_strategy="race",
            draft_shapes=frozenset({"sequence", "tree"}),
            drafting="sequence",
            pipelinable=True,
            adaptive_length=True,
            deterministic_rule=ERSD_RULE,
        ),
        _rejection_method(
            "gsd-tree",
            "multi-candidate tree (children drawn without replacement), recursive rejection",
            drafting="tree",
            lean_rows=True, deterministic_rule=DRAW_AND_DESCEND,
        ),
        _rejection_method(
            "rd",
            "randomised drafting: per-position coins with probability a; on tails drafter and "
            "verifier run concurrently, the token comes from norm((P − aQ)+)",
            drafting="coins",
            pipelinable=True, empty_draft_needs_rows=True, lean_rows=True,
        ),
        Method(
            name=AUTOREGRESSIVE,
            summary="target only (race sampling keyed on (seed, position)): the baseline",
            rule=None,
        ),
    )
}

METHOD_NAMES: tuple[str, ...] = tuple(METHODS)
SPECULATIVE_METHOD_NAMES: tuple[str, ...] = tuple(name for name, m in METHODS.items() if m.speculative)
DETERMINISTIC_METHOD_NAMES: tuple[str, ...] = tuple(
    name for name, m in METHODS.items() if m.takes_deterministic_drafts
)


def check_drafting_probability(a: float) -> None:
    """RD's a must lie in [0, 1]."""
    if not (isinstance(a, (int, float)) and math.isfinite(a) and 0.0 <= a <= 1.0):
        raise VerificationError(f"RD drafting probability a must lie in [0, 1], got {a!r}")


@cache
def _resolve(rule: str) -> VerifyFn:
    module, _, function = rule.partition(":")
    return getattr(importlib.import_module(module), function)


def get_method(name: str) -> Method:
    """The record of `name`; a ValueError naming the choices for an unknown one."""
    try:
        return METHODS[name]
    except (KeyError, TypeError):
        raise VerificationError(f"unknown method {name!r}; choose one of {', '.join(METHOD_NAMES)}") from None


def verification_method(name: str) -> Method:
    """The record of a method that verifies drafts (every method but target-only decoding)."""
    method = METHODS.get(name) if isinstance(name, str) else None
    if method is None:
        raise VerificationError(
            f"unknown verification method {name!r}; choose one of {', '.join(SPECULATIVE_METHOD_NAMES)}"
        )
    if not method.speculative:
        raise VerificationError(
            f"method {name!r} verifies no drafts; choose one of {', '.join(SPECULATIVE_METHOD_NAMES)}"
        )
    return method
