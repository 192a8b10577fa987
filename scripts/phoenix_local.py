"""Run Arize Phoenix (inside its own venv) with its OTLP/gRPC server bound to loopback only.

Phoenix binds its gRPC port on every interface whatever PHOENIX_HOST says; this wraps
``grpc.aio`` so the port is bound on 127.0.0.1, then starts ``phoenix serve``.
Not part of the pdserve package: scripts/observe.sh runs it with the Phoenix venv's Python.
"""

import sys

from grpc.aio._server import Server

_add = Server.add_insecure_port


def _loopback(self: Server, address: str) -> int:
    return _add(self, "127.0.0.1:" + address.rsplit(":", 1)[-1])


Server.add_insecure_port = _loopback  # type: ignore[method-assign, unused-ignore]

from phoenix.server.main import main  # noqa: E402 (after the patch)

sys.argv = ["phoenix", "serve"]
main()
