"""The Grafana dashboard only queries metrics the servers export, and has the panels it promises."""

from __future__ import annotations

import json
import re
from pathlib import Path

from orchestrator import metrics

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "specdec-dashboard.json"
METRIC_NAME = re.compile(r"\b(specdec_[a-zA-Z0-9_]+)\b")
SUFFIXES = {"counter": ("_total", "_created"), "gauge": ("",),
            "histogram": ("_bucket", "_count", "_sum", "_created")}


def exported_sample_names() -> set[str]:
    """Every sample name the orchestrator's and the engines' registries can expose."""
    registry = metrics.new_registry(process=False)
    metrics.OrchestratorMetrics(registry)
    metrics.EngineMetrics(registry)
    names = set()
    for family in registry.collect():  # families without samples yet are listed too
        names.update(family.name + suffix for suffix in SUFFIXES[family.type])
    return names


def queries(dashboard: dict) -> list[str]:
    found = []
    for panel in dashboard["panels"]:
        for nested in [panel, *panel.get("panels", [])]:
            found += [t["expr"] for t in nested.get("targets", [])]
    return found


def metric_names(expr: str) -> set[str]:
    without_labels = re.sub(r"\{[^}]*\}", "", expr)  # label values like "rd" are not metrics
    return set(METRIC_NAME.findall(without_labels))


def test_every_query_names_an_exported_metric():
    dashboard = json.loads(DASHBOARD.read_text())
    exported = exported_sample_names()
    exprs = queries(dashboard)
    assert len(exprs) >= 10
    for expr in exprs:
        names = metric_names(expr)
        assert names, f"no specdec metric in {expr!r}"
        assert names <= exported, f"{expr!r} names {sorted(names - exported)}, not exported"
    # and the check has teeth: a misspelt name is caught
    assert not metric_names("rate(specdec_iteration_second_count[1m])") <= exported


def test_the_promised_panels_are_there():
    dashboard = json.loads(DASHBOARD.read_text())
    titles = " | ".join(p["title"].lower() for p in dashboard["panels"])
    for needed in ("tokens / s", "acceptance by draft position", "iteration latency breakdown",
                   "overlap ratio", "rd drafted share"):
        assert needed in titles, needed
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    for panel in dashboard["panels"]:
        if panel["type"] != "row":
            assert panel["datasource"]["uid"] == "${datasource}"
