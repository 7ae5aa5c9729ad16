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

    On Linux a socket stays bound to it with ``SO_REUSEPORT``, never listening, so the
    coordinator binds beside it and nothing else takes it; elsewhere it is only chosen
    (``free_port``). See the processes guide.
    """
    if not (sys.platform.startswith("linux") and hasattr(socket, "SO_REUSEPORT")):
        yield free_port()
        return
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        s.bind(("127.0.0.1", 0))
        yield s.getsockname()[1]
