"""dashboards/: every dashboard passes the project's JSON Schema, every panel query parses as
PromQL (offline, promtool), the layout is sane, and Compose provisions exactly these files; a
freshly started gateway already exports a series (at zero) for every counter a panel or rule
reads, so a healthy fleet never shows "no data". That the queries return data from real
gateways is tests/test_ops_live.py."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
from gateway_procs import API_KEY, AUTH_TOKEN, PUBLIC_URL, GatewayProcesses, gateway_env
from ops_checks import (
    DASHBOARDS_DIR,
    SCHEMA,
    Query,
    counters_without_series,
    dashboard_files,
    metric_names,
    promtool_parse,
    queries,
    run,
    substitute,
    variables,
    walk_panels,
)

DASHBOARDS = dashboard_files()
EXPECTED = {"ivr-overview.json", "ivr-providers.json", "ivr-flows.json", "ivr-capacity.json"}


def test_the_four_dashboards_exist() -> None:
    assert {p.name for p in DASHBOARDS} == EXPECTED


def test_dashboards_pass_the_schema() -> None:
    result = run(["check-jsonschema", "--schemafile", str(SCHEMA), *map(str, DASHBOARDS)])
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_schema_catches_a_string_width_and_a_misspelt_expr(tmp_path: Path) -> None:
    board = json.loads((DASHBOARDS_DIR / "ivr-providers.json").read_text())
    board["panels"][1]["gridPos"]["w"] = "24"
    target = board["panels"][2]["targets"][0]
    target["exp"] = target.pop("expr")
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(board))
    result = run(["check-jsonschema", "--schemafile", str(SCHEMA), str(bad)])
    assert result.returncode == 1
    assert "$.panels[1].gridPos.w: '24' is not of type 'integer'" in result.stdout
    assert "$.panels[2].targets[0]: 'expr' is a required property" in result.stdout


def test_every_panel_query_parses_as_promql() -> None:
    items = queries(DASHBOARDS)
    assert len(items) > 40
    assert promtool_parse(items, variables(DASHBOARDS)) == []


def test_a_query_that_does_not_parse_is_reported_with_its_dashboard_and_panel() -> None:
    good = queries(DASHBOARDS)[:2]
    broken = Query(
        "ivr-overview.json",
        "Turn latency p95",
        "A",
        "histogram_quantile(0.95, sum by (le) "
        "(rate(ivr_turn_latency_seconds_bucket[$__rate_interval]))",
    )
    problems = promtool_parse([*good, broken])
    assert len(problems) == 1
    assert problems[0].startswith("ivr-overview.json / 'Turn latency p95' / A: ")
    assert "unclosed left parenthesis" in problems[0]


def test_macros_and_variables_are_substituted() -> None:
    expr = 'rate(x{instance=~"$instance", job="${job}", a="[[a]]"}[$__rate_interval]) * $__range'
    assert substitute(expr, {"instance": ".*", "job": "ivr"}, "2m") == (
        'rate(x{instance=~".*", job="ivr", a=".*"}[2m]) * 2m'
    )


def test_metric_names_skip_functions_labels_and_keywords() -> None:
    expr = (
        'sum by (instance, le) (rate(ivr_a_bucket{job="ivr", le="1.0"}[5m])) '
        "/ on (instance) group_left () (ivr:rec:rate5m > 0) or vector(0) + up offset 5m"
    )
    assert metric_names(expr) == {"ivr_a_bucket", "ivr:rec:rate5m", "up"}


def test_layout_ids_and_uids() -> None:
    uids = set()
    for path in DASHBOARDS:
        board = json.loads(path.read_text())
        assert board["uid"] not in uids, f"{path.name}: uid {board['uid']} used twice"
        uids.add(board["uid"])
        panels = [p for _, p in walk_panels(board["panels"])]
        ids = [p["id"] for p in panels]
        assert len(ids) == len(set(ids)), f"{path.name}: duplicate panel ids"
        cells: dict[tuple[int, int], str] = {}
        for p in panels:
            pos = p["gridPos"]
            assert pos["x"] + pos["w"] <= 24, f"{path.name}: {p['title']!r} overflows the grid"
            for x in range(pos["x"], pos["x"] + pos["w"]):
                for y in range(pos["y"], pos["y"] + pos["h"]):
                    other = cells.setdefault((x, y), p["title"])
                    assert other == p["title"], f"{path.name}: {p['title']!r} overlaps {other!r}"


def test_a_counter_a_panel_reads_without_a_series_is_reported() -> None:
    exposition = "\n".join(
        [
            "# TYPE ivr_calls_total counter",
            "# TYPE ivr_provider_errors_total counter",
            'ivr_provider_errors_total{stage="stt",provider="openai_stt",kind="timeout"} 0.0',
            "# TYPE ivr_active_calls gauge",
            "ivr_active_calls 0.0",
        ]
    )
    problems = counters_without_series(exposition, DASHBOARDS)
    assert "ivr_calls_total: declared, but no series until its first increment" in problems
    assert not [p for p in problems if "provider_errors" in p or "active_calls" in p]


@pytest.mark.slow
async def test_a_fresh_gateway_has_a_series_for_every_counter_the_dashboards_and_rules_read(
    tmp_path: Path,
) -> None:
    """Before any call: every configured provider, stage and failure kind, every outcome."""
    from ivr.errors import ProviderErrorKind
    from ivr.state.outcomes import Outcome
    from ivr.testing.openai_server import FakeOpenAIServer

    with FakeOpenAIServer(api_key=API_KEY) as fake, GatewayProcesses(tmp_path) as group:
        env = gateway_env(
            providers_url=fake.base_url,
            api_key=API_KEY,
            public_url=PUBLIC_URL,
            auth_token=AUTH_TOKEN,
            redis_url="",
            redis_prefix="",
            IVR_LLM_FALLBACK_BASE_URL=fake.base_url,
        )
        gateway = group.start("fresh", env)
        await group.wait_healthy()
        async with httpx.AsyncClient(timeout=5) as http:
            text = (await http.get(f"{gateway.base_url}/metrics")).text
    assert counters_without_series(text, DASHBOARDS) == []
    providers = {
        "stt": ["openai_stt"],
        "llm": ["openai_compat", "openai_compat_fallback"],
        "tts": ["openai_tts"],
    }
    for stage, names in providers.items():
        for name in names:
            for kind in ProviderErrorKind:
                sample = (
                    f'ivr_provider_errors_total{{kind="{kind.value}",provider="{name}",'
                    f'stage="{stage}"}} 0.0'
                )
                assert sample in text, sample
    for outcome in Outcome:
        assert f'ivr_calls_total{{outcome="{outcome.value}"}} 0.0' in text, outcome
