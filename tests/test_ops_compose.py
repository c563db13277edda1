"""deploy/compose.yaml and deploy/haproxy/haproxy.cfg, checked without a Docker engine: the
Compose binary accepts the file (and rejects a broken one), its parts point at each other
(HAProxy and Prometheus at the gateways, Grafana at every dashboard), and HAProxy accepts its
config with the addresses Compose gives it, with the timeouts and checks a call needs."""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

import pytest
import yaml
from ops_checks import PROM_DIR, REPO, dashboard_files, run

COMPOSE = REPO / "deploy" / "compose.yaml"
HAPROXY_CFG = REPO / "deploy" / "haproxy" / "haproxy.cfg"
GATEWAYS = ("gateway-1", "gateway-2")


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    result = run(["docker-compose", "-f", str(COMPOSE), "config", "--format", "json"])
    assert result.returncode == 0, result.stderr
    config: dict[str, Any] = json.loads(result.stdout)
    return config


def seconds(duration: str) -> int:
    units = {"h": 3600, "m": 60, "s": 1}
    return sum(int(n) * units[u] for n, u in re.findall(r"(\d+)([hms])", duration))


def test_compose_config_is_clean() -> None:
    result = run(["docker-compose", "-f", str(COMPOSE), "config", "-q"])
    assert result.returncode == 0, result.stderr
    assert result.stdout == "" and result.stderr == ""


def test_compose_rejects_a_broken_file(tmp_path: Path) -> None:
    shutil.copytree(REPO / "deploy", tmp_path / "deploy")
    broken = tmp_path / "deploy" / "compose.yaml"
    text = broken.read_text()
    assert '      - "127.0.0.1:9090:9090"\n' in text
    broken.write_text(
        text.replace('    ports:\n      - "127.0.0.1:9090:9090"\n', "    ports: 9090\n")
    )
    result = run(["docker-compose", "-f", str(broken), "config", "-q"])
    assert result.returncode == 1
    assert "services.prometheus.ports must be a array" in result.stderr


def test_the_stack_has_its_services(compose: dict[str, Any]) -> None:
    assert set(compose["services"]) == {*GATEWAYS, "haproxy", "redis", "prometheus", "grafana"}


def test_gateways_share_redis_and_outlive_their_drain(compose: dict[str, Any]) -> None:
    ids = set()
    for name in GATEWAYS:
        service = compose["services"][name]
        env = service["environment"]
        assert env["IVR_REDIS_URL"].startswith("redis://redis:"), name
        ids.add(env["IVR_INSTANCE_ID"])
        grace = seconds(service["stop_grace_period"])
        assert grace >= int(env["IVR_DRAIN_SECONDS"]) + 10, f"{name}: {grace} s"
        assert service["depends_on"]["redis"]["condition"] == "service_healthy"
    assert len(ids) == len(GATEWAYS), "each gateway needs its own IVR_INSTANCE_ID"


def test_haproxy_and_prometheus_point_at_the_gateways(compose: dict[str, Any]) -> None:
    env = compose["services"]["haproxy"]["environment"]
    assert [env["IVR_GATEWAY_1"], env["IVR_GATEWAY_2"]] == [f"{g}:8080" for g in GATEWAYS]
    scrape = yaml.safe_load((PROM_DIR / "prometheus.yml").read_text())["scrape_configs"]
    targets = {job["job_name"]: job["static_configs"][0]["targets"] for job in scrape}
    assert targets["ivr"] == [f"{g}:8080" for g in GATEWAYS]
    assert targets["haproxy"] == [f"haproxy{env['IVR_LB_METRICS_BIND']}"]


def test_mounted_files_exist_and_grafana_gets_every_dashboard(compose: dict[str, Any]) -> None:
    for name, service in compose["services"].items():
        for volume in service.get("volumes", []):
            if volume["type"] == "bind":
                assert Path(volume["source"]).exists(), f"{name}: {volume['source']} is missing"
    mounted = {
        Path(v["source"]).name
        for v in compose["services"]["grafana"]["volumes"]
        if v["source"].endswith(".json")
    }
    assert mounted == {p.name for p in dashboard_files()}
    provider = yaml.safe_load(
        (REPO / "deploy/grafana/provisioning/dashboards/ivr.yaml").read_text()
    )["providers"][0]
    targets = {
        str(Path(v["target"]).parent)
        for v in compose["services"]["grafana"]["volumes"]
        if v["source"].endswith(".json")
    }
    assert targets == {provider["options"]["path"]}


def haproxy_check(env: dict[str, str]) -> tuple[int, str]:
    full = {"PATH": os.environ.get("PATH", ""), **env}
    result = run(["haproxy", "-c", "-f", str(HAPROXY_CFG)], env=full)
    return result.returncode, result.stdout + result.stderr


def test_haproxy_accepts_its_config_with_composes_addresses(compose: dict[str, Any]) -> None:
    # Compose's service names do not resolve here: init-addr lets HAProxy start anyway (and
    # resolve them later), which is the only thing it may warn about.
    code, output = haproxy_check(dict(compose["services"]["haproxy"]["environment"]))
    assert code == 0, output
    warnings = [ln for ln in output.splitlines() if "WARNING" in ln]
    assert warnings and all("could not resolve address 'gateway-" in w for w in warnings), output


def test_haproxy_accepts_its_config_with_ip_addresses_without_warnings() -> None:
    env = {
        "IVR_LB_BIND": "127.0.0.1:8080",
        "IVR_LB_METRICS_BIND": "127.0.0.1:8405",
        "IVR_GATEWAY_1": "127.0.0.1:8081",
        "IVR_GATEWAY_2": "127.0.0.1:8082",
    }
    code, output = haproxy_check(env)
    assert code == 0, output
    assert "Configuration file is valid" in output and "WARNING" not in output, output


def test_haproxy_refuses_to_start_without_the_gateway_addresses() -> None:
    code, output = haproxy_check({"IVR_LB_BIND": ":8080", "IVR_LB_METRICS_BIND": ":8405"})
    assert code != 0
    assert "'server' expects <name> and <addr>" in output


def test_haproxy_keeps_calls_up_and_checks_readiness() -> None:
    cfg = HAPROXY_CFG.read_text()
    tunnel = re.search(r"^\s*timeout tunnel (\d+)h$", cfg, re.M)
    assert tunnel and int(tunnel.group(1)) >= 4, "timeout tunnel must outlast a call (4 h)"
    backend = cfg.split("backend gateways\n", 1)[1].split("\nbackend ", 1)[0]
    assert "http-check send meth GET uri /readyz" in backend
    assert "option redispatch" in cfg
    directives = [ln.split("#")[0] for ln in cfg.splitlines()]
    assert not any("shutdown-sessions" in d for d in directives), (
        "a server marked down keeps its calls"
    )
