"""The node condition `GpuHealthy` and an opt-in NoSchedule taint, through the
Kubernetes API with the official client (imported lazily: an optional extra).

The condition is written with a strategic merge patch of nodes/status, which
merges conditions by type, so kubelet's own conditions stay untouched. The
taint needs the node's current taints (the list is replaced as a whole), so
it reads the node first and needs nodes get and patch.
"""

from __future__ import annotations

import logging
from datetime import UTC, datetime
from typing import Any

from gpuwatchd.config import Config
from gpuwatchd.errors import GpuwatchdError

__all__ = ["CONDITION_TYPE", "KubernetesError", "KubernetesNode", "TAINT_KEY"]

log = logging.getLogger("gpuwatchd.remediation")

CONDITION_TYPE = "GpuHealthy"
TAINT_KEY = "gpuwatchd.io/gpu-unhealthy"
_MERGE = "application/strategic-merge-patch+json"


class KubernetesError(GpuwatchdError):
    """The client is missing, or an API call failed or timed out."""


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


class KubernetesNode:
    """One node's GpuHealthy condition and gpuwatchd taint."""

    def __init__(self, cfg: Config, node: str) -> None:
        k = cfg.remediation.kubernetes
        self.node = k.node_name or node
        self.problem_condition = k.problem_condition
        self.timeout = k.timeout
        self._api_url = k.api_url
        self._token_file = k.token_file
        self._ca_file = k.ca_file
        self._api: Any = None

    def _core(self) -> Any:
        if self._api is not None:
            return self._api
        try:
            from kubernetes import client, config  # optional extra: gpuwatchd[kubernetes]
        except ImportError:
            raise KubernetesError(
                "the kubernetes Python client is not installed (pip install gpuwatchd[kubernetes])"
            ) from None
        conf = client.Configuration()
        if self._api_url:
            conf.host = self._api_url.rstrip("/")
            if self._token_file:
                with open(self._token_file, encoding="utf-8") as fh:
                    conf.api_key = {"authorization": "Bearer " + fh.read().strip()}
            if self._ca_file:
                conf.ssl_ca_cert = self._ca_file
        else:
            try:
                config.load_incluster_config(client_configuration=conf)  # type: ignore[no-untyped-call]
            except config.ConfigException as exc:
                raise KubernetesError(f"not in a pod with a service account: {exc}") from None
        conf.proxy = None
        self._api = client.CoreV1Api(client.ApiClient(conf))
        return self._api

    def _call(self, what: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, _request_timeout=self.timeout, **kwargs)
        except KubernetesError:
            raise
        except Exception as exc:  # ApiException, urllib3 errors, timeouts: all one failure
            status = getattr(exc, "status", None)
            detail = f"HTTP {status}" if status else type(exc).__name__
            raise KubernetesError(f"{what} node {self.node}: {detail}: {exc}") from None

    def set_condition(self, healthy: bool, reason: str, message: str) -> None:
        """Write GpuHealthy=True|False with `reason` (CamelCase) and `message`."""
        now = _now()
        condition = {
            "type": CONDITION_TYPE,
            "status": "True" if healthy else "False",
            "reason": reason,
            "message": message[:1024],
            "lastHeartbeatTime": now,
            "lastTransitionTime": now,
        }
        conditions = [condition]
        if self.problem_condition:
            conditions.append(
                {**condition, "type": self.problem_condition, "status": str(not healthy)}
            )
        body = {"status": {"conditions": conditions}}
        self._call(
            "patching status of",
            self._core().patch_node_status,
            self.node,
            body,
            _content_type=_MERGE,
        )

    def _taints(self) -> list[dict[str, str]]:
        node = self._call("reading", self._core().read_node, self.node)
        spec = getattr(node, "spec", None)
        out = []
        for t in getattr(spec, "taints", None) or []:
            item = {"key": t.key, "effect": t.effect}
            if getattr(t, "value", None):
                item["value"] = t.value
            out.append(item)
        return out

    def _write_taints(self, taints: list[dict[str, str]]) -> None:
        body = {"spec": {"taints": taints}}
        self._call("patching", self._core().patch_node, self.node, body, _content_type=_MERGE)

    def taint(self, value: str) -> None:
        """Add `gpuwatchd.io/gpu-unhealthy=<value>:NoSchedule` (kept if already there)."""
        taints = self._taints()
        if any(t["key"] == TAINT_KEY for t in taints):
            return
        self._write_taints([*taints, {"key": TAINT_KEY, "value": value, "effect": "NoSchedule"}])

    def untaint(self) -> None:
        """Remove our taint; other taints stay."""
        taints = self._taints()
        kept = [t for t in taints if t["key"] != TAINT_KEY]
        if len(kept) != len(taints):
            self._write_taints(kept)
