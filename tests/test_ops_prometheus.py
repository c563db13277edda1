"""deploy/prometheus: the config and rules load, the rule unit tests pass (and can fail), every
alert is tested both firing and silent, and every metric the rules read exists."""

from __future__ import annotations

import re
import shutil
from pathlib import Path
from typing import Any

import yaml
from ops_checks import PROM_DIR, REPO, RULES, metric_names, pending_metrics, recorded_names, run
from prometheus_client import REGISTRY

import ivr.obs.metrics  # noqa: F401  (registers every metric)

RULES_TEST = PROM_DIR / "rules_test.yml"
SEVERITIES = {"critical", "warning"}


def alerts() -> list[dict[str, Any]]:
    data = yaml.safe_load(RULES.read_text())
    return [r for g in data["groups"] for r in g["rules"] if "alert" in r]


def test_promtool_accepts_the_config_and_the_rules() -> None:
    config = run(["promtool", "check", "config", "prometheus.yml"], cwd=PROM_DIR)
    assert config.returncode == 0, config.stdout + config.stderr
    rules = run(["promtool", "check", "rules", "rules.yml"], cwd=PROM_DIR)
    assert rules.returncode == 0, rules.stdout + rules.stderr
    assert "SUCCESS" in rules.stdout


def test_rule_unit_tests_pass() -> None:
    result = run(["promtool", "test", "rules", "rules_test.yml"], cwd=PROM_DIR)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


def test_rule_unit_tests_fail_when_an_alert_threshold_drifts(tmp_path: Path) -> None:
    """The unit tests pin the thresholds: a page at 50% instead of 20% errors is caught."""
    shutil.copy(RULES_TEST, tmp_path / "rules_test.yml")
    text = RULES.read_text()
    page = "ivr:provider_error_ratio:rate5m > 0.2\n"
    assert page in text
    (tmp_path / "rules.yml").write_text(text.replace(page, page.replace("0.2", "0.5")))
    result = run(["promtool", "test", "rules", "rules_test.yml"], cwd=tmp_path)
    assert result.returncode == 1
    assert "alertname: IvrProviderErrorRatioHigh" in result.stdout + result.stderr


def test_promtool_rejects_a_broken_rule(tmp_path: Path) -> None:
    broken = RULES.read_text().replace("sum by (instance, le) (", "sum by (instance, le) ((", 1)
    (tmp_path / "rules.yml").write_text(broken)
    result = run(["promtool", "check", "rules", str(tmp_path / "rules.yml")])
    assert result.returncode == 1
    assert "parse error" in result.stdout + result.stderr


def test_every_alert_is_tested_firing_and_silent() -> None:
    cases = [
        c
        for t in yaml.safe_load(RULES_TEST.read_text())["tests"]
        for c in t.get("alert_rule_test", [])
    ]
    for alert in alerts():
        name = alert["alert"]
        mine = [c for c in cases if c["alertname"] == name]
        assert any(c.get("exp_alerts") for c in mine), f"{name}: no test where it fires"
        assert any(not c.get("exp_alerts") for c in mine), f"{name}: no test where it stays silent"


def test_every_alert_has_a_severity_a_summary_and_a_runbook_section() -> None:
    readme = (REPO / "deploy" / "README.md").read_text()
    anchors = {
        re.sub(r"[^a-z0-9 -]", "", h.lower()).replace(" ", "-")
        for h in re.findall(r"^#+ (.+)$", readme, re.M)
    }
    for alert in alerts():
        name = alert["alert"]
        assert alert["labels"]["severity"] in SEVERITIES, name
        assert alert["annotations"]["summary"], name
        runbook = alert["annotations"]["runbook"]
        assert runbook.startswith("deploy/README.md#"), f"{name}: {runbook}"
        assert runbook.split("#", 1)[1] in anchors, f"{name}: deploy/README.md has no {runbook}"


def test_rules_read_only_metrics_the_gateway_exports_or_that_are_pending() -> None:
    suffixes = {"histogram": ("_bucket", "_count", "_sum"), "counter": ("_total",)}
    exported = {f.name + s for f in REGISTRY.collect() for s in suffixes.get(f.type, ("",))}
    pending = pending_metrics()
    recorded = recorded_names()
    data = yaml.safe_load(RULES.read_text())
    for rule in (r for g in data["groups"] for r in g["rules"]):
        for name in metric_names(rule["expr"]) - recorded - {"up"}:
            known = name in exported or any(name.startswith(p) for p in pending)
            assert known, f"{rule.get('alert') or rule['record']}: reads unknown metric {name}"
