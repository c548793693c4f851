"""Verification methods, one module each (docs/algorithms.md §1–§5), sharing base.py.

token     Leviathan et al. / Chen et al. token-by-token rejection (sequence drafts).
block     Sun et al. block verification (sequence drafts; never worse than token).
ersd      exponential races (sequence, batch or tree; needs no draft distributions).
gsd_tree  multi-candidate trees, recursive rejection of children drawn without replacement.
rd        randomised drafting with per-position coins (k >= 1, including the no-draft step).

The entry point is specdec.verification.dispatch.verify; what each method needs is in the
registry, specdec.methods. lean.py is the draft side of a lean verify (each node's q plus the
rows a rule reads, fetched on demand: docs/algorithms.md §12).
"""
