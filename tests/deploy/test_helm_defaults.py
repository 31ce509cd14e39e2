"""Chart defaults and the value sets shipped for each deployment in docs/deploy.md.

The ServiceMonitor and PrometheusRule follow the cluster: rendered with the
API versions a cluster with the Prometheus Operator serves, and without.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import helm_python as helm
import kubernetes_validate  # type: ignore[import-untyped]
import pytest
import yaml
from helm_python import _native

from gpuwatchd import config
from tests.deploy.test_helm_chart import CHART, KUBE_VERSIONS, daemonset

OPERATOR = ["monitoring.coreos.com/v1/ServiceMonitor", "monitoring.coreos.com/v1/PrometheusRule"]
VALUE_SETS = sorted((CHART / "ci").glob("*-values.yaml"))


def render_with(values: dict[str, Any], api_versions: list[str]) -> list[dict[str, Any]]:
    """Objects rendered as `helm install` would for a cluster serving `api_versions`."""
    opts = {"name": "gw", "namespace": "gpu-monitoring", "api_versions": api_versions}
    with helm.Chart.load(CHART) as chart:
        # helm-python's render() has no api_versions argument; its native call takes them
        raw = _native.call_string("helm_render", chart._raw(), json.dumps(values), json.dumps(opts))
    docs: list[dict[str, Any]] = []
    for path, text in json.loads(raw).items():
        if not path.endswith("NOTES.txt"):
            docs.extend(d for d in yaml.safe_load_all(text) if d)
    return docs


def kinds(objs: list[dict[str, Any]]) -> set[str]:
    return {o["kind"] for o in objs}


def test_monitoring_objects_follow_the_cluster_by_default() -> None:
    assert not {"ServiceMonitor", "PrometheusRule"} & kinds(render_with({}, []))
    assert {"ServiceMonitor", "PrometheusRule"} <= kinds(render_with({}, OPERATOR))
    only_sm = kinds(render_with({}, OPERATOR[:1]))
    assert "ServiceMonitor" in only_sm and "PrometheusRule" not in only_sm


@pytest.mark.parametrize("api", [[], OPERATOR])
def test_monitoring_objects_can_be_forced(api: list[str]) -> None:
    on = {"serviceMonitor": {"enabled": True}, "prometheusRule": {"enabled": True}}
    off = {"serviceMonitor": {"enabled": False}, "prometheusRule": {"enabled": False}}
    assert {"ServiceMonitor", "PrometheusRule"} <= kinds(render_with(on, api))
    assert not {"ServiceMonitor", "PrometheusRule"} & kinds(render_with(off, api))


def test_defaults_use_the_host_network_for_udev() -> None:
    spec = daemonset({})["spec"]["template"]["spec"]
    assert spec["hostNetwork"] is True
    assert spec["dnsPolicy"] == "ClusterFirstWithHostNet"
    pod_net = daemonset({"hostNetwork": False})["spec"]["template"]["spec"]
    assert pod_net["hostNetwork"] is False and "dnsPolicy" not in pod_net


def test_pod_resources_socket_is_mounted_read_only() -> None:
    spec = daemonset({})["spec"]["template"]["spec"]
    (vol,) = [v for v in spec["volumes"] if v["name"] == "pod-resources"]
    assert vol["hostPath"]["path"] == "/var/lib/kubelet/pod-resources"
    (mount,) = [m for m in spec["containers"][0]["volumeMounts"] if m["name"] == "pod-resources"]
    assert mount == {
        "name": "pod-resources",
        "mountPath": "/var/lib/kubelet/pod-resources",
        "readOnly": True,
    }
    off = daemonset({"podResourcesHostPath": ""})["spec"]["template"]["spec"]
    assert "pod-resources" not in {v["name"] for v in off["volumes"]}


def test_a_value_set_for_each_deployment() -> None:
    assert {p.name for p in VALUE_SETS} >= {
        "kube-prometheus-stack-values.yaml",
        "journal-only-values.yaml",
        "kern-log-file-values.yaml",
        "secured-values.yaml",
    }


@pytest.mark.parametrize("path", VALUE_SETS, ids=lambda p: p.name)
def test_value_set_lints_renders_and_validates(path: Path, tmp_path: Path) -> None:
    values = yaml.safe_load(path.read_text())
    with helm.Chart.load(CHART) as chart:
        chart.validate_schema(values)
    report = helm.lint(str(CHART), values, strict=True, namespace="gpu-monitoring")
    assert report["errors"] == [], report
    assert [m for m in report["messages"] if m["severity"] >= 2] == [], report
    objs = render_with(values, OPERATOR)
    for obj in objs:
        if obj["apiVersion"].startswith("monitoring.coreos.com/"):
            continue
        for version in KUBE_VERSIONS:
            kubernetes_validate.validate(obj, version, strict=True)
    (cm,) = [o for o in objs if o["kind"] == "ConfigMap" and "config.yaml" in o["data"]]
    data = yaml.safe_load(cm["data"]["config.yaml"])
    if data["http"].get("web_config_file"):
        web = tmp_path / "web-config.yml"  # a Secret in the cluster
        web.write_text("")
        data["http"]["web_config_file"] = str(web)
    config.load_text(yaml.safe_dump(data), str(path.name))
