"""A real kubelet pod-resources v1 gRPC server on a unix socket, for tests.

It is grpcio's server with the generated servicer, serving a List answer
loaded from JSON of the recorded shape (tests/fixtures/workloads/). `delay`
makes every call slow (deadline tests); `calls` counts them.
"""

from __future__ import annotations

import json
import threading
import time
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
from google.protobuf import json_format

from gpuwatchd.sources.workloads.proto import api_pb2, api_pb2_grpc

__all__ = ["PodResourcesServer"]


class _Servicer(api_pb2_grpc.PodResourcesListerServicer):
    def __init__(self, server: PodResourcesServer) -> None:
        self.server = server

    def List(self, request: Any, context: Any) -> Any:  # noqa: N802 (gRPC method name)
        return self.server.answer("List", lambda: self.server.response)

    def Get(self, request: Any, context: Any) -> Any:  # noqa: N802
        def one() -> Any:
            for pod in self.server.response.pod_resources:
                if (pod.name, pod.namespace) == (request.pod_name, request.pod_namespace):
                    return api_pb2.GetPodResourcesResponse(pod_resources=pod)
            context.abort(grpc.StatusCode.NOT_FOUND, "pod not found")

        return self.server.answer("Get", one)


class PodResourcesServer:
    """Serves `v1.PodResourcesLister` on `socket_path` until stop()."""

    def __init__(self, socket_path: Path, answer_json: Path | dict[str, Any]) -> None:
        self.socket_path = socket_path
        doc = json.loads(answer_json.read_text()) if isinstance(answer_json, Path) else answer_json
        doc = {k: v for k, v in doc.items() if not k.startswith("_")}
        self.response = json_format.ParseDict(doc, api_pb2.ListPodResourcesResponse())
        self.delay = 0.0
        self.calls: dict[str, int] = {}
        self._lock = threading.Lock()
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        api_pb2_grpc.add_PodResourcesListerServicer_to_server(_Servicer(self), self._server)
        self._server.add_insecure_port(f"unix://{socket_path}")

    def answer(self, method: str, build: Any) -> Any:
        with self._lock:
            self.calls[method] = self.calls.get(method, 0) + 1
        if self.delay:
            time.sleep(self.delay)
        return build()

    def start(self) -> PodResourcesServer:
        self._server.start()
        return self

    def stop(self) -> None:
        self._server.stop(grace=None).wait(5)
