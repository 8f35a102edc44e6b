"""uvicorn's server, stopped by draining: a first SIGINT/SIGTERM (or ``drain()``) stops admitting
(new requests get 503 while the socket still listens), lets in-flight requests finish for up to
the drain timeout, cancels the rest (their streams end with an error event and ``[DONE]``), and
only then closes the listener. A second signal exits at once, as uvicorn's own handler does.

uvicorn alone first closes the listener (new clients are refused at TCP level) and then cuts
whatever outlives its graceful timeout, streams included, with no final event.
"""

from __future__ import annotations

import logging
import threading
import time
from types import FrameType

import uvicorn

from selfspec.serve.app import ServerState

logger = logging.getLogger(__name__)

RELAY_GRACE_S = 0.5
"""Time the event loop gets to send the cancelled requests' last events before the listener
closes (uvicorn then still waits for open responses, up to its graceful timeout)."""


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, state: ServerState) -> None:
        super().__init__(config)
        self.state = state
        self._drain: threading.Thread | None = None

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self._drain is None and not self.should_exit:
            logger.warning(
                "draining: new requests get 503; in-flight ones have %g s",
                self.state.drain_timeout,
            )
            self.drain()
            return
        super().handle_exit(sig, frame)

    def drain(self) -> threading.Thread:
        """Start the drain on a thread (idempotent); the server exits when it ends."""
        if self._drain is None:
            self._drain = threading.Thread(
                target=self._run_drain, name="selfspec-drain", daemon=True
            )
            self._drain.start()
        return self._drain

    def _run_drain(self) -> None:
        drained = self.state.engine.shutdown(self.state.drain_timeout)
        if not drained:
            logger.warning("drain timeout: requests still in flight were cancelled")
        time.sleep(RELAY_GRACE_S)
        self.should_exit = True
