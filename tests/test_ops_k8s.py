"""deploy/k8s: the example overlay renders and validates strictly against the Kubernetes schemas
(only known CRDs may lack one), a malformed overlay fails with the resource named, and the
pieces agree with each other: probes, drain timing, selectors, autoscaling metric."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import yaml
from ops_checks import OVERLAY, k8s_resources, validate_k8s

Resources = dict[tuple[str, str], dict[str, Any]]
ADAPTER_VALUES = OVERLAY / "prometheus-adapter-values.yaml"
MARGIN_S = 10  # after the drain: close streams, flush the last state writes


@pytest.fixture(scope="module")
def resources() -> Resources:
    return {(r["kind"], r["metadata"]["name"]): r for r in k8s_resources()}


def kind(resources: Resources, name: str) -> dict[str, Any]:
    [found] = [r for (k, _), r in resources.items() if k == name]
    return found


def container(resources: Resources) -> dict[str, Any]:
    pod = kind(resources, "Deployment")["spec"]["template"]["spec"]
    found: dict[str, Any] = pod["containers"][0]
    return found


@pytest.mark.parametrize("version", ["1.29.0", None])  # None: the newest bundled (1.37)
def test_overlay_validates_strictly(version: str | None) -> None:
    assert validate_k8s(OVERLAY, version) == []


def test_overlay_renders_every_resource(resources: Resources) -> None:
    kinds = sorted(k for k, _ in resources)
    assert kinds == sorted(
        [
            "ServiceAccount",
            "ConfigMap",
            "Deployment",
            "Service",
            "PodDisruptionBudget",
            "NetworkPolicy",
            "HorizontalPodAutoscaler",
            "Ingress",
            "ServiceMonitor",
        ]
    )
    assert {r["metadata"].get("namespace") for r in resources.values()} == {"ivr"}


def write_overlay(tmp_path: Path, resources: list[str], patches: list[dict[str, Any]]) -> Path:
    (tmp_path / "kustomization.yaml").write_text(
        yaml.safe_dump(
            {
                "apiVersion": "kustomize.config.k8s.io/v1beta1",
                "kind": "Kustomization",
                "resources": [os.path.relpath(OVERLAY, tmp_path), *resources],
                "patches": patches,
            }
        )
    )
    return tmp_path


def test_a_malformed_overlay_fails_with_the_resources_named(tmp_path: Path) -> None:
    patches = [
        {
            "target": {"kind": "Deployment", "name": "ivr"},
            "patch": yaml.safe_dump(
                [
                    {
                        "op": "add",
                        "path": "/spec/template/spec/containers/0/imagePullPolicyy",
                        "value": "Always",
                    }
                ]
            ),
        },
        {
            "target": {"kind": "Service", "name": "ivr"},
            "patch": yaml.safe_dump(
                [{"op": "replace", "path": "/spec/ports/0/port", "value": "eighty"}]
            ),
        },
    ]
    problems = validate_k8s(write_overlay(tmp_path, [], patches))
    assert len(problems) == 2, problems
    joined = "\n".join(problems)
    assert "deployment/ivr" in joined and "'imagePullPolicyy' was unexpected" in joined
    assert "service/ivr" in joined and "'eighty' is not of type 'integer'" in joined


def test_an_unknown_api_version_fails_although_the_validator_only_warns(tmp_path: Path) -> None:
    (tmp_path / "old.yaml").write_text(
        yaml.safe_dump(
            {
                "apiVersion": "apps/v1beta1",
                "kind": "Deployment",
                "metadata": {"name": "old"},
                "spec": {"template": {"spec": {"containers": [{"name": "a", "image": "a"}]}}},
            }
        )
    )
    problems = validate_k8s(write_overlay(tmp_path, ["old.yaml"], []))
    assert len(problems) == 1 and "apps/v1beta1" in problems[0], problems


def test_probes_hit_the_gateway_endpoints(resources: Resources) -> None:
    c = container(resources)
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    env = {e["name"]: e.get("value") for e in c["env"]}
    assert ports["http"] == int(env["IVR_PORT"]) and env["IVR_HOST"] == "0.0.0.0"
    assert c["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "http"}
    assert c["startupProbe"]["httpGet"] == {"path": "/healthz", "port": "http"}
    assert c["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "http"}


def test_grace_period_covers_pre_stop_and_drain(resources: Resources) -> None:
    spec = kind(resources, "Deployment")["spec"]["template"]["spec"]
    c = container(resources)
    command = c["lifecycle"]["preStop"]["exec"]["command"]
    assert command[0] == "sleep"
    drain = int({e["name"]: e.get("value") for e in c["env"]}["IVR_DRAIN_SECONDS"])
    needed = int(command[1]) + drain + MARGIN_S
    assert spec["terminationGracePeriodSeconds"] >= needed, (
        f"terminationGracePeriodSeconds must be >= preStop {command[1]} s + drain {drain} s "
        f"+ {MARGIN_S} s"
    )


def test_selectors_agree(resources: Resources) -> None:
    deployment = kind(resources, "Deployment")
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    service = kind(resources, "Service")

    def selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
        return all(labels.get(k) == v for k, v in selector.items())

    assert selects(service["spec"]["selector"], pod_labels)
    pdb = kind(resources, "PodDisruptionBudget")["spec"]
    assert selects(pdb["selector"]["matchLabels"], pod_labels)
    policy = kind(resources, "NetworkPolicy")["spec"]
    assert selects(policy["podSelector"]["matchLabels"], pod_labels)
    monitor = kind(resources, "ServiceMonitor")["spec"]
    assert selects(monitor["selector"]["matchLabels"], service["metadata"]["labels"])
    service_ports = {p["name"] for p in service["spec"]["ports"]}
    assert {e["port"] for e in monitor["endpoints"]} <= service_ports
    backend = kind(resources, "Ingress")["spec"]["rules"][0]["http"]["paths"][0]["backend"]
    assert backend["service"]["name"] == service["metadata"]["name"]
    assert backend["service"]["port"]["name"] in service_ports


def test_autoscaling_on_active_calls_through_the_adapter(resources: Resources) -> None:
    hpa = kind(resources, "HorizontalPodAutoscaler")["spec"]
    deployment = kind(resources, "Deployment")
    assert hpa["scaleTargetRef"]["name"] == deployment["metadata"]["name"]
    assert "replicas" not in deployment["spec"], "the HPA owns replicas"
    [metric] = hpa["metrics"]
    assert metric["type"] == "Pods" and metric["pods"]["metric"]["name"] == "ivr_active_calls"
    rules = yaml.safe_load(ADAPTER_VALUES.read_text())["rules"]["custom"]
    served = {r["name"]["as"]: r for r in rules}
    assert "ivr_active_calls" in served, "prometheus-adapter must serve the HPA's metric"
    assert served["ivr_active_calls"]["seriesQuery"].startswith("ivr_active_calls{")
    assert hpa["minReplicas"] >= 2, "one pod cannot take over another's calls"
