"""Kubernetes pods and their GPUs, from the kubelet pod-resources v1 gRPC API.

The kubelet serves `v1.PodResourcesLister` on a unix socket
(/var/lib/kubelet/pod-resources/kubelet.sock); `List` gives every pod's
containers and the device ids assigned to them (GPU UUIDs, MIG device
UUIDs; time-sliced GPUs as `GPU-...::N`), `Get` one pod (list_pods and
get_pod here). grpcio and the
generated code (proto/) are imported only when the socket exists, so a
node without Kubernetes needs neither. Every call has a deadline.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any, NamedTuple

from gpuwatchd.errors import SourceError

__all__ = ["DEFAULT_SOCKET", "PodDevice", "PodResourcesClient", "device_key", "pod_devices"]

DEFAULT_SOCKET = "/var/lib/kubelet/pod-resources/kubelet.sock"


class PodDevice(NamedTuple):
    """One device as the kubelet assigned it: to which pod and container."""

    namespace: str
    pod: str
    container: str
    resource: str
    device_id: str


def device_key(device_id: str) -> str:
    """The GPU or MIG UUID in a device id (time-slicing appends `::N` to it)."""
    return device_id.split("::", 1)[0]


def pod_devices(pods: Any) -> dict[str, list[PodDevice]]:
    """Device key -> its assignments, from repeated PodResources messages."""
    out: dict[str, list[PodDevice]] = {}
    for pod in pods:
        for container in pod.containers:
            for dev in container.devices:
                for device_id in dev.device_ids:
                    out.setdefault(device_key(device_id), []).append(
                        PodDevice(
                            pod.namespace, pod.name, container.name, dev.resource_name, device_id
                        )
                    )
    return out


class PodResourcesClient:
    """A pod-resources v1 client on a unix socket; `SourceError` on any failure."""

    def __init__(self, socket_path: str = DEFAULT_SOCKET, timeout: float = 2.0) -> None:
        self.socket_path = socket_path
        self.timeout = timeout
        self._channel: Any = None
        self._stub: Any = None
        self._pb: Any = None

    def available(self) -> bool:
        """Whether the kubelet socket exists (the node runs a kubelet and it is mounted)."""
        return os.path.exists(self.socket_path)

    def _connect(self) -> None:
        if self._stub is not None:
            return
        try:
            import grpc

            from gpuwatchd.sources.workloads.proto import api_pb2, api_pb2_grpc
        except ImportError as exc:
            raise SourceError(f"grpcio is not installed: {exc}") from exc
        self._grpc = grpc
        self._pb = api_pb2
        self._channel = grpc.insecure_channel(f"unix://{self.socket_path}")
        self._stub = api_pb2_grpc.PodResourcesListerStub(self._channel)

    def _call(self, method: str, request: Any) -> Any:
        self._connect()
        try:
            return getattr(self._stub, method)(request, timeout=self.timeout)
        except self._grpc.RpcError as exc:
            code = exc.code() if hasattr(exc, "code") else None
            name = code.name if code is not None else "UNKNOWN"
            if name in ("UNAVAILABLE", "DEADLINE_EXCEEDED"):
                self.close()  # a fresh channel next time (the kubelet may have restarted)
            raise SourceError(f"pod-resources {method}: {name}") from exc

    def list_pods(self) -> Mapping[str, list[PodDevice]]:
        """Every assigned device, keyed by GPU/MIG UUID."""
        self._connect()
        resp = self._call("List", self._pb.ListPodResourcesRequest())
        return pod_devices(resp.pod_resources)

    def get_pod(self, namespace: str, pod: str) -> Mapping[str, list[PodDevice]]:
        """The devices of one pod (kubelet 1.27+ with the Get method enabled)."""
        self._connect()
        req = self._pb.GetPodResourcesRequest(pod_name=pod, pod_namespace=namespace)
        resp = self._call("Get", req)
        return pod_devices([resp.pod_resources]) if resp.HasField("pod_resources") else {}

    def close(self) -> None:
        """Drop the channel."""
        if self._channel is not None:
            self._channel.close()
        self._channel = self._stub = None
