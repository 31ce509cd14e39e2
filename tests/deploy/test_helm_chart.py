"""The Helm chart, rendered and linted by Helm's own Go SDK (helm-python-sdk).

Every rendered object is validated: core kinds against the Kubernetes
OpenAPI schemas (kubernetes-validate, strict: unknown fields fail), the
ServiceMonitor's relabelling and the PrometheusRule's rules by promtool,
and the generated config.yaml by gpuwatchd's own config loader.
"""

from __future__ import annotations

import copy
import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import helm_python as helm
import kubernetes_validate  # type: ignore[import-untyped]
import pytest
import yaml

from gpuwatchd import config
from tests.conftest import ROOT

CHART = ROOT / "deploy" / "helm" / "gpuwatchd"
KUBE_VERSIONS = ("1.25.0", "1.30.0", "1.33.0")
PROMTOOL = shutil.which("promtool")
HASH = "$2b$10$" + "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0"

CASES: dict[str, dict[str, Any]] = {
    "defaults": {},
    "everything-on": {
        "image": {"repository": "registry.example/gpuwatchd", "digest": "sha256:" + "a" * 64},
        "runtimeClassName": "nvidia",
        "hostNetwork": True,
        "kernelLog": {"mode": "kmsg"},
        "extraCapabilities": ["SYS_PTRACE"],
        "config": {"sources": {"nvml": {"interval": 5}}, "health": {"expected_gpus": 8}},
        "webConfig": {
            "basicAuthUsers": {"prometheus": HASH},
            "tls": {
                "enabled": True,
                "secretName": "gpuwatchd-tls",
                "clientAuthType": "VerifyClientCertIfGiven",
            },
        },
        "serviceMonitor": {
            "enabled": True,
            "labels": {"release": "kube-prometheus-stack"},
            "tlsConfig": {"insecureSkipVerify": False, "serverName": "gpuwatchd"},
            "basicAuth": {
                "username": {"name": "gpuwatchd-scrape", "key": "username"},
                "password": {"name": "gpuwatchd-scrape", "key": "password"},
            },
            "relabelings": [
                {"targetLabel": "cluster", "replacement": "dgx-a", "action": "replace"}
            ],
        },
        "prometheusRule": {"enabled": True, "labels": {"release": "kube-prometheus-stack"}},
        "dashboards": {"namespace": "grafana", "annotations": {"grafana_folder": "GPU"}},
        "extraEnv": [{"name": "PYTHONFAULTHANDLER", "value": "1"}],
        "imagePullSecrets": [{"name": "regcred"}],
    },
    "mtls": {
        "webConfig": {
            "tls": {
                "enabled": True,
                "secretName": "gpuwatchd-tls",
                "clientAuthType": "RequireAndVerifyClientCert",
                "minVersion": "TLS13",
            }
        },
        "serviceMonitor": {"enabled": True},
    },
    "kernel-log-file": {"kernelLog": {"mode": "file", "file": "/var/log/kern.log"}},
    "minimal": {
        "kernelLog": {"mode": "none"},
        "service": {"enabled": False},
        "dashboards": {"enabled": False},
        "serviceAccount": {"create": False},
        "nodeSelector": {"node-role.example/gpu": "true"},
        "affinity": {},
    },
    "existing-web-secret": {
        "webConfig": {"existingSecret": "my-web-config", "tls": {"enabled": True}},
    },
}


def render(
    values: dict[str, Any], name: str = "gw", namespace: str = "gpu-monitoring"
) -> dict[str, str]:
    with helm.Chart.load(CHART) as chart:
        out = chart.render(values=values, name=name, namespace=namespace)
    return out


def objects(values: dict[str, Any]) -> list[dict[str, Any]]:
    docs: list[dict[str, Any]] = []
    for path, text in render(values).items():
        if path.endswith("NOTES.txt"):
            continue
        docs.extend(d for d in yaml.safe_load_all(text) if d)
    return docs


def kind(objs: list[dict[str, Any]], k: str) -> list[dict[str, Any]]:
    return [o for o in objs if o["kind"] == k]


def daemonset(values: dict[str, Any]) -> dict[str, Any]:
    (ds,) = kind(objects(values), "DaemonSet")
    return ds


def container(values: dict[str, Any]) -> dict[str, Any]:
    (c,) = daemonset(values)["spec"]["template"]["spec"]["containers"]
    assert isinstance(c, dict)
    return c


# --- rendering and validation -------------------------------------------------------


@pytest.mark.parametrize("case", sorted(CASES))
def test_lint_is_clean(case: str) -> None:
    report = helm.lint(str(CHART), CASES[case], strict=True, namespace="gpu-monitoring")
    assert report["errors"] == [], report
    # severity 1 is informational ("icon is recommended"); warnings and errors fail
    assert [m for m in report["messages"] if m["severity"] >= 2] == [], report


@pytest.mark.parametrize("case", sorted(CASES))
def test_every_object_validates_against_kubernetes_schemas(case: str) -> None:
    objs = objects(CASES[case])
    assert objs
    for obj in objs:
        if obj["apiVersion"].startswith("monitoring.coreos.com/"):
            continue  # CRDs: checked with promtool below
        for version in KUBE_VERSIONS:
            kubernetes_validate.validate(obj, version, strict=True)
        assert obj["metadata"]["namespace"] in ("gpu-monitoring", "grafana")


def test_validation_can_fail() -> None:
    ds = daemonset({})
    bad = copy.deepcopy(ds)
    bad["spec"]["template"]["spec"]["containers"][0]["securityContext"]["privilegd"] = False
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, "1.30.0", strict=True)


@pytest.mark.parametrize("case", sorted(CASES))
def test_generated_config_is_accepted_by_the_daemon(case: str, tmp_path: Path) -> None:
    objs = objects(CASES[case])
    (cm,) = [o for o in kind(objs, "ConfigMap") if "config.yaml" in o["data"]]
    data = yaml.safe_load(cm["data"]["config.yaml"])
    if data["http"].get("web_config_file"):
        # the file lives in a Secret in the cluster; here any readable file will do
        web = tmp_path / "web-config.yml"
        web.write_text("")
        data["http"]["web_config_file"] = str(web)
    cfg = config.load_text(yaml.safe_dump(data), "configmap")
    assert cfg.paths.sysfs == "/host/sys"
    assert cfg.paths.procfs == "/host/proc"
    assert cfg.http.listen == "0.0.0.0:10370"
    for key, value in CASES[case].get("config", {}).get("sources", {}).get("nvml", {}).items():
        assert getattr(cfg.sources.nvml, key) == value


def test_config_change_rolls_the_pods() -> None:
    a = daemonset({})["spec"]["template"]["metadata"]["annotations"]["checksum/config"]
    b = daemonset({"config": {"sources": {"shm": {"interval": 60}}}})
    assert a != b["spec"]["template"]["metadata"]["annotations"]["checksum/config"]


# --- what the DaemonSet must and must not do ------------------------------------------


@pytest.mark.parametrize("case", sorted(CASES))
def test_never_requests_a_gpu_and_never_privileged(case: str) -> None:
    c = container(CASES[case])
    assert "nvidia.com/gpu" not in json.dumps(c.get("resources", {}))
    sc = c["securityContext"]
    assert sc["privileged"] is False
    assert sc["allowPrivilegeEscalation"] is False
    assert sc["readOnlyRootFilesystem"] is True
    assert sc["capabilities"]["drop"] == ["ALL"]
    assert set(sc["capabilities"].get("add", [])) <= {"SYSLOG", "SYS_PTRACE"}


def test_defaults_select_gpu_nodes_and_tolerate_everything() -> None:
    spec = daemonset({})["spec"]["template"]["spec"]
    terms = spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    keys = {e["key"] for t in terms["nodeSelectorTerms"] for e in t["matchExpressions"]}
    assert keys == {"nvidia.com/gpu.present", "feature.node.kubernetes.io/pci-10de.present"}
    assert spec["tolerations"] == [{"operator": "Exists"}]
    assert spec["priorityClassName"] == "system-node-critical"
    assert spec["automountServiceAccountToken"] is False
    assert "runtimeClassName" not in spec
    env = {e["name"]: e.get("value") for e in spec["containers"][0]["env"]}
    assert env["NVIDIA_VISIBLE_DEVICES"] == "all"
    assert env["NVIDIA_DRIVER_CAPABILITIES"] == "utility"
    assert "GPUWATCHD_NODE_NAME" in env


def test_host_access() -> None:
    spec = daemonset({})["spec"]["template"]["spec"]
    host = {v["name"]: v["hostPath"]["path"] for v in spec["volumes"] if "hostPath" in v}
    mounts = {m["name"]: m for m in spec["containers"][0]["volumeMounts"]}
    for name, path in {
        "sys": "/sys",
        "proc": "/proc",
        "dev-shm": "/dev/shm",
        "udev": "/run/udev",
    }.items():
        assert host[name] == path
        assert mounts[name]["readOnly"] is True
    assert mounts["state"].get("readOnly") is not True
    # auto mode by default: /dev/kmsg with SYSLOG, the journal as the fallback
    assert host["kmsg"] == "/dev/kmsg" and mounts["kmsg"]["readOnly"] is True
    assert host["machine-id"] == "/etc/machine-id"
    assert spec["containers"][0]["securityContext"]["capabilities"]["add"] == ["SYSLOG"]
    journal_only = daemonset({"kernelLog": {"mode": "journal"}})["spec"]["template"]["spec"]
    assert "SYSLOG" not in json.dumps(journal_only["containers"][0]["securityContext"])
    assert "kmsg" not in {v["name"] for v in journal_only["volumes"]}


def test_kmsg_mode_adds_syslog_and_the_device() -> None:
    values = {"kernelLog": {"mode": "kmsg"}}
    spec = daemonset(values)["spec"]["template"]["spec"]
    assert spec["containers"][0]["securityContext"]["capabilities"]["add"] == ["SYSLOG"]
    (kmsg,) = [v for v in spec["volumes"] if v["name"] == "kmsg"]
    assert kmsg["hostPath"] == {"path": "/dev/kmsg", "type": "CharDevice"}


def test_runtime_class_and_probes() -> None:
    c = container(CASES["everything-on"])
    assert daemonset(CASES["everything-on"])["spec"]["template"]["spec"]["runtimeClassName"] == (
        "nvidia"
    )
    assert c["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "http", "scheme": "HTTPS"}
    assert c["readinessProbe"]["httpGet"]["scheme"] == "HTTPS"
    assert container({})["livenessProbe"]["httpGet"]["scheme"] == "HTTP"
    # the kubelet has no client certificate: mTLS-only endpoints get a TCP probe
    assert "tcpSocket" in container(CASES["mtls"])["livenessProbe"]


def test_tls_without_secret_fails_to_render() -> None:
    with pytest.raises(helm.HelmError, match="secretName"):
        render({"webConfig": {"tls": {"enabled": True}}})


def test_web_config_secret_is_a_valid_web_config(tmp_path: Path) -> None:
    from gpuwatchd.errors import ConfigError
    from gpuwatchd.http import webconfig

    objs = objects(CASES["everything-on"])
    (secret,) = kind(objs, "Secret")
    text = secret["stringData"]["web-config.yml"]
    doc = yaml.safe_load(text)
    assert doc["basic_auth_users"] == {"prometheus": HASH}
    assert doc["tls_server_config"]["client_auth_type"] == "VerifyClientCertIfGiven"
    # gpuwatchd's own loader accepts it up to the (absent) certificate files
    path = tmp_path / "web-config.yml"
    path.write_text(text)
    with pytest.raises(ConfigError) as err:
        webconfig.load(str(path))
    assert err.value.key == "tls_server_config.cert_file"
    assert "cannot load certificate" in err.value.problem


# --- ServiceMonitor, PrometheusRule, dashboards --------------------------------------


def _snake(key: str) -> str:
    return "".join("_" + ch.lower() if ch.isupper() else ch for ch in key)


@pytest.mark.skipif(PROMTOOL is None, reason="promtool not installed")
@pytest.mark.parametrize("case", ["everything-on", "mtls"])
def test_servicemonitor_relabels_node(case: str, tmp_path: Path) -> None:
    (sm,) = kind(objects(CASES[case]), "ServiceMonitor")
    (ep,) = sm["spec"]["endpoints"]
    assert ep["port"] == "http" and ep["path"] == "/metrics"
    node = {"sourceLabels": ["__meta_kubernetes_pod_node_name"], "targetLabel": "node",
            "action": "replace"}  # fmt: skip
    assert node in ep["relabelings"]
    assert (
        sm["spec"]["selector"]["matchLabels"]
        == (daemonset(CASES[case])["spec"]["selector"]["matchLabels"])
    )
    # promtool validates the relabelling as the operator would hand it to Prometheus
    relabel = [{_snake(k): v for k, v in r.items()} for r in ep["relabelings"]]
    scrape = {
        "scrape_configs": [
            {
                "job_name": "gpuwatchd",
                "scheme": ep["scheme"],
                # Debian's Prometheus has no Kubernetes SD; the relabel checks are the same
                "static_configs": [{"targets": ["127.0.0.1:10370"]}],
                "relabel_configs": relabel,
            }
        ]
    }
    cfg = tmp_path / "prometheus.yml"
    cfg.write_text(yaml.safe_dump(scrape))
    res = subprocess.run(
        [str(PROMTOOL), "check", "config", "--syntax-only", str(cfg)],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert res.returncode == 0, res.stdout + res.stderr


RULES_SRC = ROOT / "deploy" / "prometheus" / "gpuwatchd-rules.yaml"
RULES_COPY = CHART / "files" / "gpuwatchd-rules.yaml"
DASH_SRC = ROOT / "deploy" / "grafana"
DASH_COPY = CHART / "files" / "dashboards"


def test_chart_rules_and_dashboards_are_the_sources() -> None:
    # Links, not copies: an edited rule or a regenerated dashboard is in the chart at once.
    assert RULES_SRC.exists(), "deploy/prometheus/gpuwatchd-rules.yaml is missing"
    assert RULES_COPY.is_symlink() and RULES_COPY.resolve() == RULES_SRC.resolve()
    assert DASH_COPY.is_symlink() and DASH_COPY.resolve() == DASH_SRC.resolve()
    assert {p.name for p in DASH_SRC.glob("*.json")} >= {
        "gpuwatchd-node.json",
        "gpuwatchd-fleet.json",
    }


@pytest.mark.skipif(PROMTOOL is None, reason="promtool not installed")
def test_prometheusrule_embeds_the_rules(tmp_path: Path) -> None:
    (rule,) = kind(objects(CASES["everything-on"]), "PrometheusRule")
    assert rule["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    groups = rule["spec"]["groups"]
    assert groups == yaml.safe_load(RULES_SRC.read_text())["groups"]
    path = tmp_path / "rules.yaml"
    path.write_text(yaml.safe_dump({"groups": groups}))
    res = subprocess.run(
        [str(PROMTOOL), "check", "rules", str(path)],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert res.returncode == 0, res.stdout + res.stderr


def test_dashboards_configmap_for_the_grafana_sidecar() -> None:
    (cm,) = [o for o in kind(objects(CASES["everything-on"]), "ConfigMap") if "dashboards" in
             o["metadata"]["name"]]  # fmt: skip
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert cm["metadata"]["namespace"] == "grafana"
    assert set(cm["data"]) == {p.name for p in DASH_SRC.glob("*.json")}
    for text in cm["data"].values():
        assert json.loads(text)["uid"].startswith("gpuwatchd")


# --- values.schema.json ---------------------------------------------------------------


@pytest.mark.parametrize(
    "bad",
    [
        {"port": 70000},
        {"port": "10370"},
        {"unknownKey": True},
        {"image": {"repository": ""}},
        {"image": {"pullPolicy": "Sometimes"}},
        {"image": {"digest": "latest"}},
        {"kernelLog": {"mode": "dmesg"}},
        {"kernelLog": {"file": "relative/kern.log"}},
        {"resources": {"limits": {"nvidia.com/gpu": 1}}},
        {"resources": {"requests": {"memory": "lots"}}},
        {"webConfig": {"basicAuthUsers": {"prometheus": "plaintext"}}},
        {"webConfig": {"tls": {"clientAuthType": "RequireAnyClientCert"}}},
        {"webConfig": {"tls": {"minVersion": "TLS10"}}},
        {"serviceMonitor": {"interval": "thirty seconds"}},
        {"serviceMonitor": {"enabled": "yes"}},
        {"tolerations": {"operator": "Exists"}},
        {"extraCapabilities": ["SYS_ADMIN"]},
        {"hostNetwork": "true"},
        {"stateHostPath": "var/lib/gpuwatchd"},
    ],
)
def test_schema_rejects_bad_values(bad: dict[str, Any]) -> None:
    with helm.Chart.load(CHART) as chart:
        with pytest.raises(helm.HelmValuesError):
            chart.validate_schema(bad)
    # and an install with them fails before anything is rendered
    with pytest.raises(helm.HelmError):
        render(bad)


@pytest.mark.parametrize("case", sorted(CASES))
def test_schema_accepts_the_cases(case: str) -> None:
    with helm.Chart.load(CHART) as chart:
        chart.validate_schema(CASES[case])
