"""A ZeroMQ subscriber of vLLM's KV-event stream, for tests and scripts that follow a run
(``vllm/distributed/kv_events.py``: vLLM's publisher connects, the subscriber binds).

    with Listener() as listener:
        run(..., "--kv-events", listener.endpoint)
    listener.messages  # [(sequence number, msgpack payload), ...] in arrival order

``Listener(connect=ENDPOINT)`` instead connects to a publisher that binds (a server whose
endpoint makes vLLM bind, as ``cluster.kv_events_config`` does), beside any other subscriber.

Needs ``pyzmq`` (vLLM's dependency).
"""

from __future__ import annotations

import socket
import threading
from types import TracebackType
from typing import Any

POLL_MS = 100  # how often the thread checks for a stop (and drains what is left: 2 polls)
JOIN_S = 30.0  # the longest a stop waits for the thread to drain


def free_port() -> int:
    """A loopback TCP port free at the time of asking."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Listener:
    """Binds a SUB socket on a free loopback port (or connects it to ``connect``) and
    collects every (sequence number, payload) vLLM's ZMQ publisher sends, in a thread, from
    ``__enter__`` until ``__exit__`` (which drains what has arrived)."""

    def __init__(self, connect: str | None = None) -> None:
        self.bind = connect is None
        self.endpoint = connect or f"tcp://127.0.0.1:{free_port()}"
        self.messages: list[tuple[int, bytes]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Listener:
        self._thread.start()
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._stop.set()
        self._thread.join(JOIN_S)

    def _run(self) -> None:
        import zmq

        sub: Any = zmq.Context.instance().socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        if self.bind:
            sub.bind(self.endpoint)
        else:
            sub.connect(self.endpoint)
        poller = zmq.Poller()
        poller.register(sub, zmq.POLLIN)
        while not self._stop.is_set() or poller.poll(2 * POLL_MS):
            if poller.poll(POLL_MS):
                _topic, seq, payload = sub.recv_multipart()
                self.messages.append((int.from_bytes(seq, "big"), payload))
        sub.close(0)
