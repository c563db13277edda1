"""The shipped dashboards only query metrics the gateway really exports, or ones listed in
dashboards/pending-metrics.yaml (being added). The live check (tests/test_ops_live.py) fails
once a pending metric's queries return data, until its entry is deleted."""

from __future__ import annotations

import json
import re
from pathlib import Path

from ops_checks import dashboard_files, pending_metrics, walk_panels
from prometheus_client import REGISTRY

import ivr.obs.metrics  # noqa: F401  (registers every metric)

DASHBOARDS = dashboard_files(Path(__file__).parent.parent / "dashboards")
METRIC = re.compile(r"\b(ivr_[a-z_]+)")


SUFFIXES = {"histogram": ("_bucket", "_sum", "_count"), "counter": ("_total",), "gauge": ("",)}
TYPES = {"histogram", "counter", "gauge"}


def exported_names() -> set[str]:
    """Series names, including those of labelled metrics that have no samples yet."""
    return {
        family.name + suffix
        for family in REGISTRY.collect()
        for suffix in SUFFIXES.get(family.type, ("",))
    }


def pending_names() -> set[str]:
    return {
        name + suffix
        for name, spec in pending_metrics().items()
        for suffix in SUFFIXES[spec["type"]]
    }


def test_there_is_a_dashboard() -> None:
    assert DASHBOARDS


def test_every_panel_queries_exported_or_pending_metrics_only() -> None:
    known = exported_names() | pending_names()
    for path in DASHBOARDS:
        dashboard = json.loads(path.read_text())
        assert dashboard["uid"] and dashboard["title"]
        for title, panel in walk_panels(dashboard["panels"]):
            if panel["type"] in ("row", "text"):
                continue
            assert panel["targets"], f"{path.name}: panel {title!r} has no query"
            for target in panel["targets"]:
                for name in METRIC.findall(target["expr"]):
                    assert name in known, f"{path.name}: {title!r} queries {name}"


def test_pending_metrics_are_specified() -> None:
    exported = {f.name: f.type for f in REGISTRY.collect()}
    for name, spec in pending_metrics().items():
        assert spec.get("type") in TYPES, f"pending-metrics.yaml: {name} needs a type"
        assert spec.get("help"), f"pending-metrics.yaml: {name} needs a help text"
        if name in exported:  # declared already: it must be what the dashboards assume
            assert exported[name] == spec["type"], f"{name}: {exported[name]}, not {spec['type']}"
