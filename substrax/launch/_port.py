"""The coordinator's port: a free loopback port, held by the launcher for the whole run."""

from __future__ import annotations

import contextlib
import socket
import sys
from collections.abc import Iterator


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now.

    The coordinator binds it a moment later; only loopback is ever used, so the
    coordinator is never reachable from another machine.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def reserved_port() -> Iterator[int]:
    """A free loopback port for the coordinator, held until the run ends.

    Between choosing a port and process 0's coordinator binding it lie seconds (each
    child imports JAX first), in which any other process on the machine can take it: a
    bind to port 0 (as gloo's listeners do) or a connection's ephemeral port. Process 0
    then fails with "Address already in use". So on Linux the launcher keeps a socket
    bound to the port with ``SO_REUSEPORT``, never listening: the coordinator (gRPC sets
    ``SO_REUSEPORT`` on its listeners) binds beside it and gets every connection, while
    any other bind to the port fails and no connection takes it as its local port.
    Elsewhere the port is only chosen (``free_port``). The children do not inherit the
    socket (Python's sockets are close-on-exec).
    """
    if not (sys.platform.startswith("linux") and hasattr(socket, "SO_REUSEPORT")):
        yield free_port()
        return
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        s.bind(("127.0.0.1", 0))
        yield s.getsockname()[1]
