"""The shipped dashboards only query metrics the gateway really exports."""

from __future__ import annotations

import json
import re
from pathlib import Path

from prometheus_client import REGISTRY

import ivr.obs.metrics  # noqa: F401  (registers every metric)

DASHBOARDS = sorted(Path(__file__).parent.parent.joinpath("dashboards").glob("*.json"))
METRIC = re.compile(r"\b(ivr_[a-z_]+)")


SUFFIXES = {"histogram": ("_bucket", "_sum", "_count"), "counter": ("_total",), "gauge": ("",)}


def exported_names() -> set[str]:
    """Series names, including those of labelled metrics that have no samples yet."""
    return {
        family.name + suffix
        for family in REGISTRY.collect()
        for suffix in SUFFIXES.get(family.type, ("",))
    }


def test_there_is_a_dashboard() -> None:
    assert DASHBOARDS


def test_every_panel_queries_exported_metrics_only() -> None:
    exported = exported_names()
    for path in DASHBOARDS:
        dashboard = json.loads(path.read_text())
        assert dashboard["uid"] and dashboard["title"]
        for panel in dashboard["panels"]:
            assert panel["targets"], f"{path.name}: panel {panel['title']!r} has no query"
            for target in panel["targets"]:
                for name in METRIC.findall(target["expr"]):
                    assert name in exported, f"{path.name}: {panel['title']!r} queries {name}"
