"""The live round (tests/ops_stack.py, also ``scripts/stack --check``): two real gateways behind
HAProxy (deploy/haproxy/haproxy.cfg), Redis, and Prometheus with deploy/prometheus/rules.yml;
simulated Twilio calls through HAProxy on a healthy fleet (no provider fails, no stream is
refused); then every dashboard query and every recording rule must return data (non-empty, no
NaN) from that Prometheus, the error panels zeros, and a renamed metric must fail naming the
query and the metric. The table is saved to test-artifacts/ops-live-check.txt."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
import pytest_asyncio
from ops_checks import (
    REPO,
    Row,
    dashboard_files,
    format_table,
    live_check,
    pending_metrics,
    recorded_names,
)
from ops_stack import Stack, drive_traffic, run_stack, settle, startup_rows

from ivr.sim.caller import CallReport

pytestmark = [pytest.mark.slow, pytest.mark.timeout(150), pytest.mark.asyncio(loop_scope="module")]

ARTIFACTS = REPO / "test-artifacts"
Live = tuple[Stack, list[CallReport], list[Row]]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def live(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Live]:
    async with run_stack(tmp_path_factory.mktemp("ops-stack")) as stack:
        before = await startup_rows(stack)
        reports = await drive_traffic(stack)
        await settle(stack)
        yield stack, reports, before


def save_artifact(name: str, text: str) -> Path:
    ARTIFACTS.mkdir(exist_ok=True)
    (ARTIFACTS / ".gitignore").write_text("*\n")  # the directory ignores itself
    path = ARTIFACTS / name
    path.write_text(text + "\n")
    return path


async def test_calls_went_through_haproxy_to_both_gateways(live: Live) -> None:
    stack, reports, _ = live
    for report in reports:
        assert not report.errors, report.format_transcript()
        assert len(report.turns) >= 2, report.format_transcript()
    for gateway in stack.gateways:
        assert gateway.log_events("call.stream_started"), f"{gateway.name} carried no call"


async def test_every_counter_a_panel_reads_has_a_series_before_the_first_call(
    live: Live,
) -> None:
    _, _, before = live
    assert before and not [r for r in before if r.failed], format_table(before)


async def test_every_dashboard_query_and_recording_rule_returns_data_on_a_healthy_fleet(
    live: Live,
) -> None:
    stack, _, before = live
    rows = before + live_check(stack.prom_url, dashboard_files(), stack.window())
    table = format_table(rows)
    path = save_artifact("ops-live-check.txt", table)
    failed = [r for r in rows if r.failed]
    assert not failed, f"(table: {path})\n" + format_table(failed)
    pending = pending_metrics()
    for row in rows:
        if row.status == "PENDING":
            assert any(name in row.what + row.detail for name in pending), row
    recorded = [r for r in rows if r.what.startswith("rules.yml / 'ivr:")]
    assert len(recorded) == len(recorded_names()), table
    assert all(r.status == "OK" for r in recorded), table
    # Nothing failed, and the error panels say so with zeros, not "no data".
    errors = [r for r in rows if "Errors per second" in r.what or "error ratio" in r.what.lower()]
    assert errors and all(r.status == "OK" for r in errors), format_table(errors)
    for row in errors:
        assert {float(v) for v in row.detail.replace(", ...", "").split(", ")} == {0.0}, row


async def test_a_renamed_metric_fails_naming_the_query_and_the_metric(
    live: Live, tmp_path: Path
) -> None:
    stack, _, _ = live
    source = REPO / "dashboards" / "ivr-capacity.json"
    renamed = tmp_path / source.name
    renamed.write_text(source.read_text().replace("ivr_active_calls", "ivr_active_call"))
    rows = live_check(stack.prom_url, [renamed], stack.window())
    failed = [r for r in rows if r.failed]
    assert failed, format_table(rows)
    active = [r for r in failed if r.what == "ivr-capacity.json / 'Active calls' / A"]
    assert active, format_table(failed)
    assert active[0].status == "EMPTY"
    assert "metric ivr_active_call not found (did you mean ivr_active_calls?)" in active[0].detail
    assert "expr: sum(ivr_active_call)" in active[0].detail


async def test_a_pending_metric_is_pending_until_it_has_data_then_must_be_flipped(
    live: Live, tmp_path: Path
) -> None:
    stack, _, _ = live
    board = tmp_path / "pending.json"
    board.write_text(json.dumps({"panels": [{"title": "p", "type": "stat", "targets": [
        {"refId": "A", "expr": "sum(ivr_not_there_yet_seconds_count)"},
        {"refId": "B", "expr": "sum(increase(ivr_calls_total[$__range]))"},
    ]}]}))  # fmt: skip
    contract = {"type": "histogram", "help": "x"}
    pending = {"ivr_not_there_yet_seconds": contract, "ivr_calls": {**contract, "type": "counter"}}
    rows = live_check(stack.prom_url, [board], stack.window(), pending=pending)
    by_query = {r.what.rsplit(" / ", 1)[1]: r for r in rows if r.what.startswith("pending.json")}
    assert by_query["A"].status == "PENDING" and not by_query["A"].failed
    assert "waits for ivr_not_there_yet_seconds" in by_query["A"].detail
    assert by_query["B"].status == "FLIP" and by_query["B"].failed
    assert "has data now: delete ivr_calls from pending-metrics.yaml" in by_query["B"].detail


async def test_the_rules_evaluate_cleanly_on_real_data(live: Live) -> None:
    """Vector matching errors (many-to-many, duplicate series) only show on real series."""
    stack, _, _ = live
    async with httpx.AsyncClient(timeout=5.0) as http:
        groups = (await http.get(f"{stack.prom_url}/api/v1/rules")).json()["data"]["groups"]
    names = {g["name"] for g in groups}
    assert names == {"ivr-slo-turn-latency", "ivr-providers", "ivr-alerts"}
    for group in groups:
        for rule in group["rules"]:
            assert rule["health"] == "ok", json.dumps(rule, indent=1)[:1500]
            if rule["type"] == "alerting":
                assert rule["state"] != "firing", json.dumps(rule, indent=1)[:1500]
