"""The chart's opt-in remediation RBAC: nothing by default, nodes/status patch for
the condition, nodes get/patch only with the taint; the token is mounted only then."""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("helm_python")

from tests.deploy.test_helm_chart import daemonset, kind, objects  # noqa: E402


def _rules(values: dict[str, Any]) -> list[dict[str, Any]]:
    roles = kind(objects(values), "ClusterRole")
    return [r for role in roles for r in role["rules"]]


def _token(values: dict[str, Any]) -> bool:
    return bool(daemonset(values)["spec"]["template"]["spec"]["automountServiceAccountToken"])


def test_default_grants_nothing_and_mounts_no_token() -> None:
    objs = objects({})
    assert not kind(objs, "ClusterRole") and not kind(objs, "ClusterRoleBinding")
    assert _token({}) is False


def test_condition_only_patches_node_status() -> None:
    values = {"remediation": {"nodeCondition": True}}
    assert _rules(values) == [
        {"apiGroups": [""], "resources": ["nodes/status"], "verbs": ["patch"]}
    ]
    assert _token(values) is True
    (binding,) = kind(objects(values), "ClusterRoleBinding")
    (sa,) = kind(objects(values), "ServiceAccount")
    assert binding["subjects"][0]["name"] == sa["metadata"]["name"]


def test_taint_adds_nodes_get_and_patch() -> None:
    values = {"remediation": {"nodeCondition": True, "nodeTaint": True}}
    assert {"apiGroups": [""], "resources": ["nodes"], "verbs": ["get", "patch"]} in _rules(values)
    assert all("list" not in r["verbs"] and "delete" not in r["verbs"] for r in _rules(values))
