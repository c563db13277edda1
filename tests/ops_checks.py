"""Checks for what ships in deploy/ and dashboards/: static (schemas, linters, promtool) and live
(every dashboard query against a Prometheus that scrapes real gateways).

Used by tests/test_ops_*.py and by ``scripts/ops-check`` (run it against any Prometheus, for
example the Compose stack's: ``scripts/ops-check --prom http://127.0.0.1:9090 --window 15m``).
Tools come from PATH or .venv/bin; scripts/setup-ops installs them.
"""

from __future__ import annotations

import argparse
import difflib
import json
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import yaml

REPO = Path(__file__).resolve().parent.parent
DASHBOARDS_DIR = REPO / "dashboards"
SCHEMA = DASHBOARDS_DIR / "schema.json"
PENDING_FILE = DASHBOARDS_DIR / "pending-metrics.yaml"
PROM_DIR = REPO / "deploy" / "prometheus"
RULES = PROM_DIR / "rules.yml"
OVERLAY = REPO / "deploy" / "k8s" / "overlays" / "example"
KNOWN_CRDS = {("monitoring.coreos.com/v1", "ServiceMonitor")}
"""Kinds kubernetes-validate has no schema for and that we check ourselves instead."""

SUFFIXES = ("_bucket", "_count", "_sum", "_total", "_created")
Pending = dict[str, dict[str, Any]]
"""pending-metrics.yaml: metric name -> its contract (type, labels, help)."""


class ToolMissing(RuntimeError):
    """A command-line tool the checks need is not installed."""


def tool(name: str) -> str:
    """The path of ``name`` (PATH first, then .venv/bin), or a clear error saying how to get it."""
    found = shutil.which(name) or shutil.which(name, path=str(REPO / ".venv" / "bin"))
    if found is None:
        raise ToolMissing(f"{name} is not installed: run scripts/setup-ops")
    return found


def run(
    args: Sequence[str],
    *,
    cwd: Path | None = None,
    stdin: str | None = None,
    env: dict[str, str] | None = None,
    timeout: float = 60.0,
) -> subprocess.CompletedProcess[str]:
    """Run a tool (first element resolved by ``tool``); output captured as text."""
    return subprocess.run(
        [tool(args[0]), *args[1:]],
        cwd=cwd,
        input=stdin,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


# -- dashboards -----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Query:
    dashboard: str
    panel: str
    ref_id: str
    expr: str

    @property
    def where(self) -> str:
        return f"{self.dashboard} / {self.panel!r} / {self.ref_id}"


def dashboard_files(directory: Path = DASHBOARDS_DIR) -> list[Path]:
    """Every dashboard (``*.json`` except the schema)."""
    return sorted(p for p in directory.glob("*.json") if p.name != SCHEMA.name)


Panel = dict[str, Any]


def walk_panels(panels: list[Panel], parent: str = "") -> Iterator[tuple[str, Panel]]:
    """(title path, panel) for every panel, including those nested in collapsed rows."""
    for panel in panels:
        title = f"{parent}{panel.get('title', '?')}"
        yield title, panel
        yield from walk_panels(panel.get("panels") or [], f"{title} / ")


def queries(paths: Sequence[Path]) -> list[Query]:
    out = []
    for path in paths:
        board = json.loads(path.read_text())
        for title, panel in walk_panels(board.get("panels") or []):
            for target in panel.get("targets") or []:
                out.append(Query(path.name, title, target.get("refId", "?"), target["expr"]))
    return out


def variables(paths: Sequence[Path]) -> dict[str, str]:
    """Template variables -> the value a query gets offline: the current one unless it is
    "All" or unset (then ``.*``, which every ``=~`` filter accepts)."""
    values: dict[str, str] = {}
    for path in paths:
        for var in json.loads(path.read_text()).get("templating", {}).get("list", []):
            current = (var.get("current") or {}).get("value")
            usable = isinstance(current, str) and current not in ("", "$__all")
            values[var["name"]] = str(current) if usable else ".*"
    return values


def substitute(expr: str, values: dict[str, str], window: str) -> str:
    """Grafana's macros and variables replaced, so Prometheus can run the expression."""
    for macro in ("__rate_interval", "__interval", "__range"):
        expr = expr.replace(f"${{{macro}}}", window).replace(f"${macro}", window)
    expr = expr.replace("$__range_s", "60")

    def var(match: re.Match[str]) -> str:
        name = next(g for g in match.groups() if g)
        return values.get(name, ".*")

    return re.sub(r"\$\{(\w+)(?::\w+)?\}|\[\[(\w+)\]\]|\$(\w+)", var, expr)


_KEYWORDS = {
    "by",
    "without",
    "on",
    "ignoring",
    "group_left",
    "group_right",
    "bool",
    "and",
    "or",
    "unless",
    "offset",
    "inf",
    "nan",
    "atan2",
}


def metric_names(expr: str) -> set[str]:
    """Metric names in a PromQL expression: identifiers that are not functions, keywords,
    label names (in braces or grouping lists), strings or durations."""
    text = re.sub(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'', '""', expr)
    text = re.sub(r"\{[^}]*\}", " ", text)
    text = re.sub(r"\[[^\]]*\]", " ", text)
    text = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", text)
    names = set()
    for match in re.finditer(r"(?<![\w.])([a-zA-Z_:][\w:]*)(\s*\()?", text):
        name, call = match.group(1), match.group(2)
        if not call and name.lower() not in _KEYWORDS:
            names.add(name)
    return names


def base_name(name: str) -> str:
    for suffix in SUFFIXES:
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return name


def pending_metrics(path: Path = PENDING_FILE) -> Pending:
    data = yaml.safe_load(path.read_text()) or {}
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a mapping of metric name -> description")
    return data


def is_pending(name: str, pending: Pending) -> bool:
    return name in pending or base_name(name) in pending


def promtool_parse(items: Sequence[Query], values: dict[str, str] | None = None) -> list[str]:
    """Parse every query offline (as recording rules, through ``promtool check rules``);
    one message per query that does not parse, naming its dashboard, panel and refId."""
    groups = [
        {
            "name": f"q{i}",
            "rules": [
                {"record": "dashboard:query", "expr": substitute(q.expr, values or {}, "5m")}
            ],
        }
        for i, q in enumerate(items)
    ]
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "dashboard-queries.yml"
        path.write_text(yaml.safe_dump({"groups": groups}, sort_keys=False))
        result = run(["promtool", "check", "rules", str(path)])
    if result.returncode == 0:
        return []
    problems = []
    for line in (result.stdout + result.stderr).splitlines():
        found = re.search(r'group "q(\d+)", rule \d+, "dashboard:query": (.*)', line)
        if found:
            query = items[int(found.group(1))]
            problems.append(f"{query.where}: {found.group(2)}\n    expr: {query.expr}")
    return problems or [f"promtool check rules failed: {result.stdout}{result.stderr}"]


# -- Prometheus rules -----------------------------------------------------------------------------


def rule_exprs(path: Path = RULES) -> list[tuple[str, str]]:
    """(rule name, expr) for every recording and alerting rule."""
    data = yaml.safe_load(path.read_text())
    return [
        (rule.get("record") or rule["alert"], rule["expr"])
        for group in data["groups"]
        for rule in group["rules"]
    ]


def recorded_names(path: Path = RULES) -> set[str]:
    data = yaml.safe_load(path.read_text())
    return {r["record"] for g in data["groups"] for r in g["rules"] if "record" in r}


# -- Kubernetes -----------------------------------------------------------------------------------


def validate_k8s(overlay: Path = OVERLAY, version: str | None = None) -> list[str]:
    """Render ``overlay`` with kustomize and validate every resource strictly; one message per
    problem, naming the resource. Only the CRDs in KNOWN_CRDS may lack a schema."""
    rendered = run(["kubectl", "kustomize", str(overlay)])
    if rendered.returncode != 0:
        return [f"kubectl kustomize {overlay} failed: {rendered.stderr.strip()}"]
    if not rendered.stdout.strip():
        return [f"kubectl kustomize {overlay} rendered nothing"]
    args = ["kubernetes-validate", "--strict", "--quiet"]
    if version:
        args += ["--kubernetes-version", version]
    result = run([*args, "-"], stdin=rendered.stdout)
    problems = [
        ln
        for ln in result.stdout.splitlines() + result.stderr.splitlines()
        if ln.startswith("ERROR")
    ]
    for line in (result.stdout + result.stderr).splitlines():
        missing = re.search(r"Couldn't find schema for kind (\S+) with api version (\S+)", line)
        if missing and (missing.group(2), missing.group(1)) not in KNOWN_CRDS:
            problems.append(f"ERROR - no schema (unknown apiVersion or kind?): {line}")
    if result.returncode != 0 and not problems:
        problems.append(f"kubernetes-validate failed: {result.stdout}{result.stderr}")
    return problems


def k8s_resources(overlay: Path = OVERLAY) -> list[dict[str, Any]]:
    rendered = run(["kubectl", "kustomize", str(overlay)])
    if rendered.returncode != 0:
        raise RuntimeError(f"kubectl kustomize {overlay} failed: {rendered.stderr}")
    return [doc for doc in yaml.safe_load_all(rendered.stdout) if doc]


# -- live -----------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Row:
    what: str
    status: str  # OK | PENDING | EMPTY | NAN | ERROR | FLIP (pending metric with data now)
    series: int
    detail: str

    @property
    def failed(self) -> bool:
        return self.status not in ("OK", "PENDING")


class Prometheus:
    """A tiny client for Prometheus' HTTP API."""

    def __init__(self, url: str, timeout: float = 10.0) -> None:
        self.url = url.rstrip("/")
        self.http = httpx.Client(timeout=timeout)

    def close(self) -> None:
        self.http.close()

    def names(self) -> set[str]:
        resp = self.http.get(f"{self.url}/api/v1/label/__name__/values")
        resp.raise_for_status()
        return set(resp.json()["data"])

    def query(self, expr: str) -> dict[str, Any]:
        resp = self.http.post(f"{self.url}/api/v1/query", data={"query": expr})
        body: dict[str, Any] = resp.json()
        return body


def _values(data: dict[str, Any]) -> list[float]:
    if data["resultType"] == "scalar":
        return [float(data["result"][1])]
    if data["resultType"] == "vector":
        return [float(item["value"][1]) for item in data["result"]]
    return [float(v[1]) for item in data["result"] for v in item["values"]]


def _missing_detail(expr: str, known: set[str]) -> str:
    """Why a query came back empty, naming the metrics Prometheus does not have."""
    hints = []
    for name in sorted(n for n in metric_names(expr) if n not in known):
        close = difflib.get_close_matches(name, sorted(known), n=1)
        hints.append(f"metric {name} not found" + (f" (did you mean {close[0]}?)" if close else ""))
    return "; ".join(hints) or "no series: its metrics exist but this query selects nothing"


def check_query(
    prom: Prometheus, query: Query, expr: str, known: set[str], pending: Pending
) -> Row:
    """OK: data, none NaN. A query on a pending metric is PENDING until it has real data
    (a value other than 0: a declared but unwired metric reads 0 or NaN), then FLIP, a
    failure until its entry leaves pending-metrics.yaml and the query is held to data."""
    body = prom.query(expr)
    if body.get("status") != "success":
        return Row(query.where, "ERROR", 0, f"{body.get('error')}  expr: {expr}")
    values = _values(body["data"])
    bad = [v for v in values if math.isnan(v) or math.isinf(v)]
    waits_for = sorted({base_name(n) for n in metric_names(expr) if is_pending(n, pending)})
    if waits_for:
        if values and not bad and any(values):
            detail = f"has data now: delete {', '.join(waits_for)} from pending-metrics.yaml"
            return Row(query.where, "FLIP", len(values), f"{detail}  expr: {expr}")
        why = "no series" if not values else "only NaN/0 (declared, not fed yet?)"
        detail = f"waits for {', '.join(waits_for)} (pending-metrics.yaml): {why}"
        return Row(query.where, "PENDING", len(values), f"{detail}  expr: {expr}")
    if not values:
        return Row(query.where, "EMPTY", 0, f"{_missing_detail(expr, known)}  expr: {expr}")
    if bad:
        return Row(
            query.where,
            "NAN",
            len(values),
            f"{len(bad)} of {len(values)} values NaN/Inf  expr: {expr}",
        )
    shown = ", ".join(f"{v:.4g}" for v in values[:3]) + (", ..." if len(values) > 3 else "")
    return Row(query.where, "OK", len(values), shown)


def live_check(
    prom_url: str,
    paths: Sequence[Path],
    window: str,
    rules: Path = RULES,
    pending: Pending | None = None,
) -> list[Row]:
    """Every dashboard query, every recording rule's series and every metric the rules read,
    against a live Prometheus; ``pending`` defaults to dashboards/pending-metrics.yaml. A query
    with no series fails (EMPTY): on a healthy fleet every panel must answer, zeros included."""
    pending = pending_metrics() if pending is None else pending
    values = variables(paths)
    prom = Prometheus(prom_url)
    try:
        known = prom.names()
        rows = [
            check_query(prom, q, substitute(q.expr, values, window), known, pending)
            for q in queries(paths)
        ]
        rows += recording_rule_rows(prom, known, pending, rules)
        rows += rule_metric_rows(known, pending, rules)
    finally:
        prom.close()
    return rows


def recording_rule_rows(
    prom: Prometheus, known: set[str], pending: Pending, rules: Path = RULES
) -> list[Row]:
    """One row per recording rule: its recorded series, as a query (dashboards and alerts read
    them; a rule that records nothing leaves them blank)."""
    data = yaml.safe_load(rules.read_text())
    rows = []
    for group in data["groups"]:
        for rule in group["rules"]:
            if "record" in rule:
                query = Query("rules.yml", rule["record"], "recorded", rule["record"])
                row = check_query(prom, query, rule["record"], known, pending)
                if row.status == "EMPTY":
                    expr = " ".join(rule["expr"].split())
                    row = Row(row.what, "EMPTY", 0, f"the rule records no series; expr: {expr}")
                rows.append(row)
    return rows


def counters_without_series(
    exposition: str, paths: Sequence[Path], rules: Path = RULES
) -> list[str]:
    """The counters a dashboard query or a rule reads that a gateway's ``/metrics`` text
    (``exposition``) declares but has no sample of: a labelled counter the gateway did not
    start at zero, whose panels would read "no data" until its first increment."""
    types: dict[str, str] = {}
    sampled: set[str] = set()
    for line in exposition.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ", 3)
            types[name] = kind.strip()
        elif line and not line.startswith("#"):
            sampled.add(re.split(r"[{ ]", line, maxsplit=1)[0])
    read = {n for q in queries(paths) for n in metric_names(q.expr)}
    read |= {n for _, expr in rule_exprs(rules) for n in metric_names(expr)}
    problems = []
    for name in sorted(read):
        family = base_name(name)
        counter = "counter" in (types.get(family), types.get(f"{family}_total"))
        if counter and f"{family}_total" not in sampled:
            problems.append(f"{family}_total: declared, but no series until its first increment")
    return problems


def rule_metric_rows(known: set[str], pending: Pending, rules: Path) -> list[Row]:
    """One row per metric the rules read: present, pending, or missing."""
    recorded = recorded_names(rules)
    used: dict[str, list[str]] = {}
    for name, expr in rule_exprs(rules):
        for metric in metric_names(expr) - recorded:
            used.setdefault(metric, []).append(name)
    rows = []
    for metric, users in sorted(used.items()):
        what = f"rules.yml / {metric}"
        readers = ", ".join(sorted(set(users)))
        if is_pending(metric, pending):
            state = "exported, not flipped yet" if metric in known else "not exported yet"
            rows.append(Row(what, "PENDING", int(metric in known), f"{state}; read by {readers}"))
        elif metric in known:
            rows.append(Row(what, "OK", 1, f"read by {readers}"))
        else:
            close = difflib.get_close_matches(metric, sorted(known), n=1)
            hint = f" (did you mean {close[0]}?)" if close else ""
            rows.append(
                Row(what, "EMPTY", 0, f"metric {metric} not found{hint}; read by {readers}")
            )
    return rows


def format_table(rows: Sequence[Row]) -> str:
    width = min(max((len(r.what) for r in rows), default=10), 90)
    lines = [f"{'STATUS':8} {'N':>3}  {'QUERY':{width}}  DETAIL"]
    for r in rows:
        lines.append(f"{r.status:8} {r.series:>3}  {r.what:{width}}  {r.detail}")
    counts: dict[str, int] = {}
    for r in rows:
        counts[r.status] = counts.get(r.status, 0) + 1
    lines.append("summary: " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())))
    return "\n".join(lines)


# -- command line ---------------------------------------------------------------------------------


def static_checks() -> list[str]:
    """Every offline check, as 'name: problem' lines (empty when all pass)."""
    problems: list[str] = []
    paths = dashboard_files()
    schema = run(["check-jsonschema", "--schemafile", str(SCHEMA), *map(str, paths)])
    if schema.returncode:
        problems.append(f"dashboards schema: {schema.stdout}{schema.stderr}")
    problems += [f"dashboard PromQL: {p}" for p in promtool_parse(queries(paths), variables(paths))]
    for args, cwd in (
        (["promtool", "check", "config", "prometheus.yml"], PROM_DIR),
        (["promtool", "test", "rules", "rules_test.yml"], PROM_DIR),
        (["hadolint", "deploy/Dockerfile"], REPO),
        (["docker-compose", "-f", "deploy/compose.yaml", "config", "-q"], REPO),
    ):
        result = run(args, cwd=cwd)
        if result.returncode:
            problems.append(f"{' '.join(args)}: {result.stdout}{result.stderr}")
    problems += [f"kubernetes: {p}" for p in validate_k8s()]
    return problems


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="scripts/ops-check", description=__doc__.split("\n")[0])
    parser.add_argument("--prom", help="live check: a Prometheus URL that scrapes the gateways")
    parser.add_argument("--window", default="5m", help="what $__rate_interval/$__range become")
    parser.add_argument("--out", type=Path, help="also write the live table to this file")
    args = parser.parse_args(argv)
    if not args.prom:
        problems = static_checks()
        print("\n".join(problems) if problems else "static checks: all passed")
        return 1 if problems else 0
    rows = live_check(args.prom, dashboard_files(), args.window)
    table = format_table(rows)
    print(table)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(table + "\n")
    return 1 if any(r.failed for r in rows) else 0


if __name__ == "__main__":
    os.chdir(REPO)
    sys.exit(main())
