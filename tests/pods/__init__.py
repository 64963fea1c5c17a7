"""Pods of the tests' own, beside ``tests/backend.py``: servers that speak what the backend does not.

Each module runs as ``python -m pods.<name> --port 0 --control-port 0`` (started by
``harness.ModulePod``), prints ``READY <port> <control_port>`` once it listens, and records
its own peak concurrency, served as JSON on the control port (``podstats``):

- ``ws_echo``: a WebSocket echo server (python ``websockets``);
- ``grpc_pod``: a gRPC server (``grpcio``, bytes in and out, no generated code);
- ``stream_pod``: a raw HTTP/1.1 server whose chunked event stream sends one event each
  time the test says so, and stops mid-body when the test says nothing.
"""
