"""RunState has one writer: the loop (orchestrator/speculation.py). Output, accounting and the
proposers return values (output.Absorbed, accounting.Tally, Step.counts) and the loop applies them.

The check reads every orchestrator module's syntax tree for a write to a RunState field: an
assignment, augmented assignment or deletion whose target runs through `state.<field>` (or a name
bound to such an expression), and a mutating call (append, extend, add, …) on one. A negative control
shows the check finds each kind of write, aliases included.
"""

from __future__ import annotations

import ast
from dataclasses import fields
from pathlib import Path

import pytest

from orchestrator.run import RunState

ROOT = Path(__file__).resolve().parents[2]
WRITER = "orchestrator/speculation.py"
FIELDS = {f.name for f in fields(RunState)}
MUTATORS = {"append", "extend", "insert", "pop", "remove", "clear", "update", "add", "setdefault",
            "sort", "reverse", "popitem", "discard", "__setitem__", "__delitem__"}


def _chain(node: ast.AST) -> list[str]:
    """The names along an attribute or subscript chain, root first (`run.state.stats.x`: run, state,
    stats, x)."""
    names: list[str] = []
    while True:
        if isinstance(node, ast.Attribute):
            names.append(node.attr)
            node = node.value
        elif isinstance(node, ast.Subscript):
            node = node.value
        elif isinstance(node, ast.Call):
            node = node.func
        elif isinstance(node, ast.Name):
            names.append(node.id)
            return names[::-1]
        else:
            return names[::-1]


def _reaches_state(chain: list[str], aliases: set[str]) -> bool:
    """Whether a chain reaches into a RunState field: `...state.<field>...` or through an alias of one."""
    if chain and chain[0] in aliases:
        return True
    return any(a == "state" and b in FIELDS for a, b in zip(chain, chain[1:], strict=False))


def state_writes(source: str) -> list[int]:
    """Line numbers of writes to a RunState field in `source`."""
    tree = ast.parse(source)
    aliases: set[str] = set()
    for node in ast.walk(tree):  # names bound to a RunState field (or to the field's insides)
        if isinstance(node, ast.Assign) and _reaches_state(_chain(node.value), set()):
            aliases.update(t.id for t in node.targets if isinstance(t, ast.Name))
    lines = []
    for node in ast.walk(tree):
        targets: list[ast.AST] = []
        if isinstance(node, ast.Assign | ast.Delete):
            targets = list(node.targets)
        elif isinstance(node, ast.AugAssign | ast.AnnAssign):
            targets = [node.target]
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            if node.func.attr in MUTATORS and _reaches_state(_chain(node.func.value), aliases):
                lines.append(node.lineno)
            continue
        flat = [e for t in targets for e in (t.elts if isinstance(t, ast.Tuple) else [t])]
        if any(not isinstance(t, ast.Name) and _reaches_state(_chain(t), aliases) for t in flat):
            lines.append(node.lineno)
    return lines


def test_only_the_loop_writes_run_state() -> None:
    writes = {}
    for path in sorted((ROOT / "orchestrator").rglob("*.py")):
        name = path.relative_to(ROOT).as_posix()
        found = state_writes(path.read_text())
        if found and name != WRITER:
            writes[name] = found
    assert not writes, f"RunState written outside the loop ({WRITER}): {writes}"
    assert state_writes((ROOT / WRITER).read_text()), "the loop itself writes RunState"


@pytest.mark.parametrize("snippet", [
    "def f(run):\n    run.state.generated.append(1)\n",
    "def f(run):\n    run.state.finish_reason = 'eos'\n",
    "def f(state):\n    state.text, state.text_tail = 'a', ''\n",
    "def f(run):\n    run.state.stats.iterations += 1\n",
    "def f(run):\n    stats = run.state.stats\n    stats.pre_drafts_used += 1\n",
    "def f(run):\n    counts = run.state.calibration\n    counts.clear()\n",
    "def f(run):\n    del run.state.iterations[0]\n",
])
def test_the_check_finds_every_kind_of_write(snippet: str) -> None:
    assert state_writes(snippet), snippet


def test_the_check_lets_reads_and_other_states_be() -> None:
    assert not state_writes("def f(run):\n    n = len(run.state.generated)\n    x = run.state.text + 'a'\n")
    assert not state_writes("def f(request):\n    request.state.caller = 1\n")  # Starlette's request.state
