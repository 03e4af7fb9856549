"""stream/publish.py: a publisher whose stream starts with the run's log header."""

from __future__ import annotations

import socket

import msgspec
import pytest

from kvsched.config import SchedulerConfig
from kvsched.events.wire import Subscriber, WireError
from kvsched.stream.publish import open_publisher


def free_endpoint() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


def test_a_waiting_subscriber_receives_the_log_header_first():
    endpoint = free_endpoint()
    with Subscriber(endpoint, timeout_s=10) as sub:
        publisher = open_publisher(endpoint, SchedulerConfig(num_blocks=64), wait_subscribers=1)
        publisher.close()
        first = next(iter(sub))
    assert first.kind == "header"
    assert msgspec.msgpack.decode(first.payload)["config"]["num_blocks"] == 64


def test_an_endpoint_that_cannot_be_bound_is_a_wire_error():
    with pytest.raises(WireError, match="cannot bind"):
        open_publisher("nonsense://x", SchedulerConfig())
