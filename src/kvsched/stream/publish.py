"""Publishing a run's event stream: a ZeroMQ publisher that starts with the log header."""

from __future__ import annotations

from kvsched.config import SchedulerConfig
from kvsched.engine import log_header
from kvsched.events.codec import encode
from kvsched.events.wire import Publisher

__all__ = ["open_publisher"]


def open_publisher(
    endpoint: str, config: SchedulerConfig, wait_subscribers: int = 0
) -> Publisher:
    """Bind a publisher and send the stream's header (the log header: schema version,
    kvsched version, config) once ``wait_subscribers`` subscribers are there (or 10 s)."""
    publisher = Publisher(endpoint, wait_subscribers=wait_subscribers)
    try:
        publisher.start(encode(log_header(config)))
    except BaseException:
        publisher.close()
        raise
    return publisher
