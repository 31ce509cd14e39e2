"""The kubelet pod-resources v1 API: vendored api.proto and its generated Python code.

api_pb2.py and api_pb2_grpc.py are generated and checked in;
regenerate from the repository root after changing api.proto:

    .venv/bin/python -m grpc_tools.protoc -I . --python_out=. \
        --grpc_python_out=. gpuwatchd/sources/workloads/proto/api.proto

Import them only where grpcio is known to be installed (podresources.py does it lazily).
"""
