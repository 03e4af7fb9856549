"""Tests for the live event stream over ZeroMQ (tcp loopback, ephemeral ports)."""

from __future__ import annotations

import json
import logging
import os
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import pytest
import zmq

from kvsched.events.wire import (
    TOPIC,
    Message,
    Publisher,
    Subscriber,
    WireError,
    WireTimeout,
    decode_frames,
    encode_frames,
)

ANY_PORT = "tcp://127.0.0.1:*"
HEADER = b"\x83header-msgpack"
SAFETY_S = 5.0  # never reached when the tests pass; keeps a failing test from hanging


def steps(n: int) -> list[bytes]:
    return [f"step-{i}".encode() * (1 + i % 7) for i in range(n)]


def expected_stream(payloads: list[bytes], header_every: int) -> list[Message]:
    stream = [Message("header", 0, HEADER)]
    for seq, payload in enumerate(payloads):
        if header_every and seq and seq % header_every == 0:
            stream.append(Message("header", seq, HEADER))
        stream.append(Message("step", seq, payload))
    return [*stream, Message("end", len(payloads), b"")]


def seq(n: int) -> bytes:
    return struct.pack(">Q", n)


@pytest.fixture
def raw_xpub() -> Iterator[tuple[zmq.Socket[bytes], str]]:
    """A bare XPUB socket (a PUB that reports subscriptions) for hand-written frames."""
    context = zmq.Context()
    socket = context.socket(zmq.XPUB)
    socket.setsockopt(zmq.SNDHWM, 0)
    socket.bind(ANY_PORT)
    try:
        yield socket, socket.getsockopt_string(zmq.LAST_ENDPOINT)
    finally:
        socket.close(linger=0)
        context.term()


def await_subscription(socket: zmq.Socket[bytes]) -> None:
    assert socket.poll(int(SAFETY_S * 1000), zmq.POLLIN), "no subscription arrived"
    assert socket.recv() == b"\x01" + TOPIC


def follow(subscriber: Subscriber) -> list[Message]:
    with subscriber:
        return list(subscriber)


# --------------------------------------------------------------------------- the format


def test_a_message_is_four_frames_topic_kind_big_endian_seq_payload() -> None:
    frames = encode_frames("step", 258, b"record")

    assert frames == [b"kvsched", b"S", b"\x00\x00\x00\x00\x00\x00\x01\x02", b"record"]
    assert decode_frames(frames) == Message("step", 258, b"record")
    assert encode_frames("header", 7, b"h")[1] == b"H"
    assert encode_frames("end", 9) == [b"kvsched", b"E", seq(9), b""]


# --------------------------------------------------------------------------- round trips


def test_a_subscriber_started_first_receives_the_header_every_step_and_the_end_in_order() -> None:
    payloads = steps(120)
    received: list[Message] = []
    failures: list[BaseException] = []
    facts: dict[str, object] = {}

    with Publisher(ANY_PORT, wait_subscribers=1, wait_timeout_s=SAFETY_S, header_every=50) as pub:

        def consume() -> None:
            try:
                with Subscriber(pub.endpoint, timeout_s=SAFETY_S) as sub:
                    received.extend(sub)
                    facts.update(gaps=sub.gaps, first_seq=sub.first_seq, header=sub.header)
            except BaseException as exc:  # re-raised in the test's thread
                failures.append(exc)

        thread = threading.Thread(target=consume)
        thread.start()
        pub.start(HEADER)
        for payload in payloads:
            pub.publish(payload)
        assert pub.sent == len(payloads)
    thread.join(SAFETY_S)

    assert not thread.is_alive()
    assert not failures, failures
    assert received == expected_stream(payloads, header_every=50)
    assert facts == {"gaps": [], "first_seq": 0, "header": HEADER}


def test_start_waits_for_every_subscriber_it_was_told_to_and_each_gets_the_whole_stream() -> None:
    payloads = steps(30)
    with ExitStack() as stack:
        pub = stack.enter_context(Publisher(ANY_PORT, wait_subscribers=2, wait_timeout_s=SAFETY_S))
        subs = [stack.enter_context(Subscriber(pub.endpoint, timeout_s=SAFETY_S)) for _ in range(2)]
        pub.start(HEADER)
        assert pub.subscriptions == 2
        for payload in payloads:
            pub.publish(payload)
        pub.close()  # sends the end

        for sub in subs:
            assert list(sub) == expected_stream(payloads, header_every=1000)
            assert sub.gaps == []


_FOLLOWER = """
import json, sys
from kvsched.events.wire import Subscriber
with Subscriber(sys.argv[1], timeout_s=float(sys.argv[2])) as sub:
    messages = list(sub)
print(json.dumps({
    "stream": [[m.kind, m.seq, m.payload.hex()] for m in messages],
    "gaps": sub.gaps,
    "header": sub.header.hex(),
}))
"""


def test_a_subscriber_in_another_process_follows_the_stream_to_the_end() -> None:
    payloads = steps(100)
    src = str(Path(__file__).resolve().parents[2] / "src")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([src, os.environ.get("PYTHONPATH", "")])}
    with Publisher(ANY_PORT, wait_subscribers=1, wait_timeout_s=10.0, header_every=40) as pub:
        follower = subprocess.Popen(
            [sys.executable, "-c", _FOLLOWER, pub.endpoint, "10"],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            pub.start(HEADER)
            assert pub.subscriptions == 1
            for payload in payloads:
                pub.publish(payload)
        except BaseException:
            follower.kill()
            raise
    out, err = follower.communicate(timeout=10)

    assert follower.returncode == 0, err
    result = json.loads(out)
    expected = expected_stream(payloads, header_every=40)
    assert result["stream"] == [[m.kind, m.seq, m.payload.hex()] for m in expected]
    assert result["gaps"] == []
    assert result["header"] == HEADER.hex()


def test_a_late_subscriber_reports_its_first_seq_and_learns_the_header_from_a_re_send() -> None:
    payloads = steps(25)
    with ExitStack() as stack:
        pub = stack.enter_context(Publisher(ANY_PORT, header_every=10))
        pub.start(HEADER)  # nobody listens yet: waits for no one
        for payload in payloads[:5]:
            pub.publish(payload)  # dropped: no subscriber
        late = stack.enter_context(Subscriber(pub.endpoint, timeout_s=SAFETY_S))
        assert pub.wait_for_subscribers(1, SAFETY_S)
        for payload in payloads[5:]:
            pub.publish(payload)
        pub.close()  # sends the end

        received = list(late)

    assert received[0] == Message("step", 5, payloads[5])
    assert late.first_seq == 5
    assert late.gaps == []
    assert late.header == HEADER
    headers = [m.seq for m in received if m.kind == "header"]
    assert headers == [10, 20]
    assert [m.seq for m in received if m.kind == "step"] == list(range(5, 25))
    assert received[-1] == Message("end", 25, b"")


# --------------------------------------------------------------------------- gaps


def test_a_skipped_step_seq_is_recorded_as_a_gap_and_every_message_is_still_delivered(
    raw_xpub: tuple[zmq.Socket[bytes], str],
) -> None:
    socket, endpoint = raw_xpub
    sub = Subscriber(endpoint, timeout_s=SAFETY_S)
    await_subscription(socket)
    frames = [
        [TOPIC, b"H", seq(0), HEADER],
        [TOPIC, b"S", seq(0), b"a"],
        [TOPIC, b"S", seq(1), b"b"],
        [TOPIC, b"S", seq(3), b"d"],  # seq 2 never sent
        [TOPIC, b"S", seq(4), b"e"],
        [TOPIC, b"E", seq(5), b""],
    ]
    for message in frames:
        socket.send_multipart(message)

    received = follow(sub)

    assert [m.seq for m in received if m.kind == "step"] == [0, 1, 3, 4]
    assert sub.gaps == [(2, 3)]
    assert sub.first_seq == 0
    assert received[-1] == Message("end", 5, b"")


def test_a_message_over_the_subscribers_size_cap_is_never_delivered_and_the_follow_ends(
    raw_xpub: tuple[zmq.Socket[bytes], str],
) -> None:
    socket, endpoint = raw_xpub
    sub = Subscriber(endpoint, timeout_s=0.5, max_message_bytes=1024)
    await_subscription(socket)
    received = iter(sub)
    socket.send_multipart([TOPIC, b"H", seq(0), HEADER])
    socket.send_multipart([TOPIC, b"S", seq(0), b"a"])
    assert [next(received).kind, next(received).payload] == ["header", b"a"]

    socket.send_multipart([TOPIC, b"S", seq(1), bytes(64 * 1024)])  # over the cap
    # The subscriber drops the connection (its subscription goes) instead of taking it.
    assert socket.poll(int(SAFETY_S * 1000), zmq.POLLIN) and socket.recv() == b"\x00" + TOPIC
    socket.send_multipart([TOPIC, b"E", seq(2), b""])
    with pytest.raises(WireTimeout, match="after 2 messages"):
        next(received)
    sub.close()


def test_steps_lost_just_before_the_end_show_as_a_gap_at_the_end_message(
    raw_xpub: tuple[zmq.Socket[bytes], str],
) -> None:
    socket, endpoint = raw_xpub
    sub = Subscriber(endpoint, timeout_s=SAFETY_S)
    await_subscription(socket)
    for message in ([TOPIC, b"S", seq(7), b"x"], [TOPIC, b"E", seq(10), b""]):
        socket.send_multipart(message)

    received = follow(sub)

    assert [m.kind for m in received] == ["step", "end"]
    assert sub.first_seq == 7  # a late joiner's first message is its start, not a gap
    assert sub.gaps == [(8, 10)]
    assert sub.header is None


# --------------------------------------------------------------------------- failures


def test_binding_an_endpoint_already_in_use_raises_wire_error_naming_it() -> None:
    with Publisher(ANY_PORT) as first:
        with pytest.raises(WireError, match="cannot bind publisher to") as info:
            Publisher(first.endpoint)
        assert first.endpoint in str(info.value)
        assert "in use" in str(info.value).lower()


@pytest.mark.parametrize("endpoint", ["tcp://127.0.0.1:not-a-port", "nonsense://x"])
def test_binding_a_bad_endpoint_raises_wire_error_naming_it(endpoint: str) -> None:
    with pytest.raises(WireError, match=f"cannot bind publisher to {endpoint}: "):
        Publisher(endpoint)


def test_connecting_a_subscriber_to_a_bad_endpoint_raises_wire_error_naming_it() -> None:
    with pytest.raises(WireError, match="cannot connect subscriber to nonsense://x: "):
        Subscriber("nonsense://x")


def test_with_no_subscriber_start_gives_up_after_the_wait_timeout_and_proceeds(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with Publisher(ANY_PORT, wait_subscribers=1, wait_timeout_s=0.2) as pub:
        began = time.monotonic()
        with caplog.at_level(logging.WARNING, logger="kvsched.events.wire"):
            pub.start(HEADER)
        waited = time.monotonic() - began
        for payload in steps(3):
            pub.publish(payload)

        assert 0.2 <= waited < 2.0
        assert pub.sent == 3
        assert f"publisher on {pub.endpoint}: 0 of 1 subscribers after 0.2 s" in caplog.text


@pytest.mark.parametrize(
    ("frames", "complaint"),
    [
        ([TOPIC, b"S"], "expected 4 frames, got 2"),
        ([TOPIC, b"S", seq(0), b"x", b"extra"], "expected 4 frames, got 5"),
        ([TOPIC + b"-other", b"S", seq(0), b"x"], "topic b'kvsched-other'"),
        ([TOPIC, b"X", seq(0), b"x"], "unknown kind b'X'"),
        ([TOPIC, b"S", b"\x00" * 4, b"x"], "seq frame is 4 bytes, expected 8"),
    ],
    ids=["too-few-frames", "too-many-frames", "wrong-topic", "unknown-kind", "short-seq"],
)
def test_a_malformed_message_raises_wire_error_saying_what_is_wrong(
    raw_xpub: tuple[zmq.Socket[bytes], str], frames: list[bytes], complaint: str
) -> None:
    socket, endpoint = raw_xpub
    with Subscriber(endpoint, timeout_s=SAFETY_S) as sub:
        await_subscription(socket)
        socket.send_multipart(frames)
        with pytest.raises(WireError, match="malformed message from") as info:
            next(iter(sub))
    assert endpoint in str(info.value)
    assert complaint in str(info.value)


def test_a_subscriber_that_hears_nothing_within_its_timeout_raises_wire_timeout() -> None:
    with Publisher(ANY_PORT) as pub, Subscriber(pub.endpoint, timeout_s=0.1) as sub:
        began = time.monotonic()
        with pytest.raises(WireTimeout, match=f"no message from {pub.endpoint} within 0.1 s"):
            next(iter(sub))
        assert time.monotonic() - began < 2.0
    assert issubclass(WireTimeout, WireError)


def test_publishing_before_start_or_after_close_raises_and_close_is_idempotent() -> None:
    pub = Publisher(ANY_PORT, linger_s=0)
    with pytest.raises(WireError, match="call start"):
        pub.publish(b"x")
    pub.start(HEADER)
    with pytest.raises(WireError, match="already started"):
        pub.start(HEADER)
    pub.close()
    pub.close()
    assert pub.closed
    with pytest.raises(WireError, match="is closed"):
        pub.publish(b"x")
