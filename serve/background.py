"""Serve a `ServerState` on a free loopback port from a background thread, in this process.

For tests and benchmarks that need real sockets (SSE, disconnects, concurrency) without a
subprocess: uvicorn's own `Server.run` on a daemon thread, stopped through `should_exit`.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import uvicorn

from selfspec.serve.app import ServerState, create_app
from selfspec.serve.draining import DrainingServer

START_TIMEOUT_S = 30.0


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextmanager
def running_server(
    state: ServerState, graceful_shutdown_s: int = 10
) -> Iterator[tuple[str, uvicorn.Server]]:
    """(base URL, uvicorn server) of `state` served on 127.0.0.1; stopped on exit (in-flight
    requests get uvicorn's graceful timeout; ``server.drain()`` drains first)."""
    config = uvicorn.Config(
        create_app(state),
        host="127.0.0.1",
        port=free_port(),
        log_level="warning",
        timeout_graceful_shutdown=graceful_shutdown_s,
    )
    server = DrainingServer(config, state)
    thread = threading.Thread(target=server.run, name="selfspec-uvicorn", daemon=True)
    thread.start()
    deadline = time.monotonic() + START_TIMEOUT_S
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError(f"the server did not start within {START_TIMEOUT_S:.0f} s")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{config.port}", server
    finally:
        server.should_exit = True
        thread.join(timeout=30)


__all__ = ["free_port", "running_server"]
