"""Live event stream over ZeroMQ: a publisher of step records and a subscriber that follows it.

The payloads are opaque ``bytes`` here (the event log's records, msgpack-encoded elsewhere);
this module is only the transport. This docstring is the wire specification: another
implementation that follows it interoperates.

Sockets
    The publisher binds a ZeroMQ ``XPUB`` socket (``SNDHWM`` 0); subscribers connect ``SUB``
    sockets (``RCVHWM`` 0) subscribed to the topic prefix ``b"kvsched"``. With both high-water
    marks at 0 nothing is dropped for a slow subscriber: messages queue in memory instead (the
    publisher never blocks). The publisher sets ``XPUB_VERBOSE`` so that every subscription
    message (``b"\\x01" + prefix``) reaches it; a subscription whose prefix is a prefix of
    ``b"kvsched"`` counts as one subscriber. ``Publisher.start`` can wait for a number of them.

Message
    Every message is a multipart message of exactly 4 frames::

        [b"kvsched", kind, seq, payload]

    * frame 0, topic: the 7 ASCII bytes ``b"kvsched"``;
    * frame 1, kind: one byte, ``b"H"`` header, ``b"S"`` step, ``b"E"`` end;
    * frame 2, seq: 8 bytes, big-endian unsigned;
    * frame 3, payload: the header bytes (``H``), one step record (``S``), empty (``E``).

    A message with another frame count, topic, kind or seq length is malformed; the subscriber
    raises :class:`WireError` on it. A subscriber refuses a frame longer than its
    ``max_message_bytes`` (ZeroMQ's ``MAXMSGSIZE``, 256 MiB unless told): ZeroMQ drops the
    connection instead of delivering (or allocating) it, and does not reconnect after such a
    protocol error, so nothing more arrives and the follow ends at the subscriber's timeout.

Sequence numbers
    A message's seq is the number of step messages the publisher sent before it. Step
    messages are numbered 0, 1, 2, ... in the order sent; a header or end message carries the
    seq of the next step (so a header sent before step k, and an end after k steps, carry k).
    Hence, on one stream, the seq of every message equals the seq the receiver expects next.

Ordering
    One publisher sends: the header (once ``start`` has waited), then the steps in order, with
    the header sent again just before every step whose seq is a positive multiple of
    ``header_every`` (0: never again), then one end message when the publisher closes.
    ZeroMQ delivers the messages of one connection in order.

Late joiners
    A subscriber that connects after the stream started receives a contiguous suffix of it,
    from the first message sent after its subscription reached the publisher. That first
    message, of any kind, defines its start, ``Subscriber.first_seq`` (its seq: the first step
    this subscriber can expect), and is not a gap. It may see steps before any header: the
    header is known (``Subscriber.header``) from the next re-send on.

Gaps
    After its first message the subscriber expects each message's seq to equal the next step
    seq (the last step's seq + 1, or the seq of the last header). A message whose seq differs
    records the gap ``(expected, received)`` in ``Subscriber.gaps`` and resynchronises on the
    received seq; the message is delivered anyway (the consumer decides). An end message whose
    seq differs reveals steps lost just before the end. Gaps arise when a connection breaks and
    ZeroMQ reconnects (messages queued on the broken connection are lost) or when a publisher
    restarts on the same endpoint (its seqs start again at 0). The steps a subscriber received
    are exactly ``range(first_seq, end seq)`` less the gaps' ranges.

End
    The end message is the last one of a stream; the subscriber yields it and stops. The
    publisher then closes its socket with a linger (``linger_s``) so queued messages can still
    be delivered.

Both classes are single-threaded: use each from one thread at a time.
"""

from __future__ import annotations

import logging
import struct
import time
from collections.abc import Iterator
from typing import Final, Literal

import attrs
import zmq

from kvsched.events.closing import Closing

__all__ = [
    "KINDS",
    "MAX_MESSAGE_BYTES",
    "TOPIC",
    "Message",
    "Publisher",
    "Subscriber",
    "WireError",
    "WireTimeout",
    "decode_frames",
    "encode_frames",
]

TOPIC: Final = b"kvsched"
MAX_MESSAGE_BYTES: Final = 256 << 20  # a subscriber's default cap on one received frame
Kind = Literal["header", "step", "end"]
KINDS: Final[dict[bytes, Kind]] = {b"H": "header", b"S": "step", b"E": "end"}
_KIND_BYTES: Final[dict[Kind, bytes]] = {kind: code for code, kind in KINDS.items()}
_SEQ = struct.Struct(">Q")
_HEADER, _STEP, _END = b"H", b"S", b"E"
_logger = logging.getLogger("kvsched.events.wire")


class WireError(Exception):
    """The stream cannot be published or followed (bind failure, malformed message, misuse)."""


class WireTimeout(WireError):
    """No message arrived within the subscriber's timeout."""


@attrs.frozen
class Message:
    """One message of the stream (see the module docstring for the meaning of ``seq``)."""

    kind: Kind
    seq: int
    payload: bytes


def encode_frames(kind: Kind, seq: int, payload: bytes = b"") -> list[bytes]:
    """The 4 frames of one message."""
    return [TOPIC, _KIND_BYTES[kind], _SEQ.pack(seq), payload]


def decode_frames(frames: list[bytes], source: str = "the stream") -> Message:
    """Parse one multipart message; raise :class:`WireError` if it is malformed."""
    if len(frames) != 4:
        raise WireError(f"malformed message from {source}: expected 4 frames, got {len(frames)}")
    topic, kind, seq, payload = frames
    if topic != TOPIC:
        raise WireError(f"malformed message from {source}: topic {topic!r}, expected {TOPIC!r}")
    name = KINDS.get(kind)
    if name is None:
        raise WireError(
            f"malformed message from {source}: unknown kind {kind!r} (expected b'H', b'S' or b'E')"
        )
    if len(seq) != _SEQ.size:
        raise WireError(
            f"malformed message from {source}: seq frame is {len(seq)} bytes, expected {_SEQ.size}"
        )
    return Message(name, _SEQ.unpack(seq)[0], payload)


# --------------------------------------------------------------------------- publisher


class Publisher(Closing):
    """Publishes a header, then step records, then an end message, on a bound XPUB socket."""

    def __init__(
        self,
        endpoint: str,
        *,
        wait_subscribers: int = 0,
        wait_timeout_s: float = 10.0,
        header_every: int = 1000,
        linger_s: float = 2.0,
    ) -> None:
        if wait_subscribers < 0:
            raise ValueError(f"wait_subscribers must be >= 0, not {wait_subscribers}")
        if header_every < 0:
            raise ValueError(f"header_every must be >= 0 (0: never re-sent), not {header_every}")
        self.wait_subscribers = wait_subscribers
        self.wait_timeout_s = wait_timeout_s
        self.header_every = header_every
        self.linger_s = linger_s
        self.sent = 0
        self.subscriptions = 0
        self._header: bytes | None = None
        self._closed = False
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.XPUB)
        try:
            self._socket.setsockopt(zmq.SNDHWM, 0)
            self._socket.setsockopt(zmq.XPUB_VERBOSE, 1)
            self._socket.bind(endpoint)
            self.endpoint: str = self._socket.getsockopt_string(zmq.LAST_ENDPOINT)
        except zmq.ZMQError as exc:
            self._socket.close(linger=0)
            self._context.term()
            self._closed = True
            raise WireError(f"cannot bind publisher to {endpoint}: {exc}") from exc

    def start(self, header: bytes) -> None:
        """Wait for ``wait_subscribers`` subscribers (at most ``wait_timeout_s``); send ``header``.

        On timeout it logs a warning and proceeds.
        """
        self._check_open()
        if self._header is not None:
            raise WireError(f"publisher on {self.endpoint} already started")
        if not self.wait_for_subscribers(self.wait_subscribers, self.wait_timeout_s):
            _logger.warning(
                "publisher on %s: %d of %d subscribers after %.1f s; publishing anyway",
                self.endpoint,
                self.subscriptions,
                self.wait_subscribers,
                self.wait_timeout_s,
            )
        self._header = bytes(header)
        self._send(_HEADER, self._header)

    def wait_for_subscribers(self, count: int, timeout_s: float) -> bool:
        """Wait until ``count`` subscriptions in all have been seen; return whether they were."""
        self._check_open()
        deadline = time.monotonic() + timeout_s
        self._read_subscriptions()
        while self.subscriptions < count:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            if self._socket.poll(max(1, round(remaining * 1000)), zmq.POLLIN):
                self._read_subscriptions()
        return True

    def publish(self, payload: bytes) -> None:
        """Send one step record (seq = ``sent``), after a header re-send when one is due."""
        self._check_open()
        if self._header is None:
            raise WireError(f"publisher on {self.endpoint}: call start(header) before publish")
        seq = self.sent
        if self.header_every and seq and seq % self.header_every == 0:
            self._read_subscriptions()  # keeps the queue of subscription messages short
            self._send(_HEADER, self._header)
        self._socket.send_multipart([TOPIC, _STEP, _SEQ.pack(seq), payload])
        self.sent = seq + 1

    def close(self) -> None:
        """Send the end message, then close the socket, lingering ``linger_s``; idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            self._send(_END, b"")
        finally:
            self._socket.close(linger=max(0, round(self.linger_s * 1000)))
            self._context.term()

    @property
    def closed(self) -> bool:
        return self._closed

    def _send(self, kind: bytes, payload: bytes) -> None:
        self._socket.send_multipart([TOPIC, kind, _SEQ.pack(self.sent), payload])

    def _read_subscriptions(self) -> None:
        while True:
            try:
                message = self._socket.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            if message[:1] == b"\x01" and TOPIC.startswith(message[1:]):
                self.subscriptions += 1

    def _check_open(self) -> None:
        if self._closed:
            raise WireError(f"publisher on {self.endpoint} is closed")

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"sent={self.sent}"
        return f"Publisher({self.endpoint!r}, {state})"


# --------------------------------------------------------------------------- subscriber


_POLL_SLICE_S: Final = 0.1  # the longest a subscriber waits before Python handles a signal


class Subscriber(Closing):
    """Follows a stream: iterate it for messages, in order, up to and including the end."""

    def __init__(
        self,
        endpoint: str,
        *,
        timeout_s: float | None = None,
        max_message_bytes: int = MAX_MESSAGE_BYTES,
    ) -> None:
        self.endpoint = endpoint
        self.timeout_s = timeout_s
        self.header: bytes | None = None
        self.gaps: list[tuple[int, int]] = []
        self.first_seq: int | None = None
        self.next_seq: int | None = None
        self.received = 0
        self.ended = False
        self._closed = False
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.SUB)
        try:
            self._socket.setsockopt(zmq.RCVHWM, 0)
            self._socket.setsockopt(zmq.MAXMSGSIZE, max_message_bytes)
            self._socket.setsockopt(zmq.SUBSCRIBE, TOPIC)
            self._socket.connect(endpoint)
        except zmq.ZMQError as exc:
            self._socket.close(linger=0)
            self._context.term()
            self._closed = True
            raise WireError(f"cannot connect subscriber to {endpoint}: {exc}") from exc

    def __iter__(self) -> Iterator[Message]:
        while not self.ended:
            if self._closed:
                raise WireError(f"subscriber to {self.endpoint} is closed")
            if not self._wait(self.timeout_s):
                raise WireTimeout(
                    f"no message from {self.endpoint} within {self.timeout_s} s "
                    f"(after {self.received} messages)"
                )
            message = decode_frames(self._socket.recv_multipart(), self.endpoint)
            self._track(message)
            yield message

    def _wait(self, timeout_s: float | None) -> bool:
        """Whether a message arrived within ``timeout_s`` (None: wait as long as it takes).
        The wait is cut into short polls: a signal (Ctrl-C) that the OS hands to one of
        ZeroMQ's threads only runs its Python handler when the main thread leaves the poll."""
        deadline = None if timeout_s is None else time.monotonic() + max(0.0, timeout_s)
        while True:
            slice_s = _POLL_SLICE_S
            if deadline is not None:
                slice_s = min(slice_s, max(0.0, deadline - time.monotonic()))
            if self._socket.poll(round(slice_s * 1000), zmq.POLLIN):
                return True
            if deadline is not None and time.monotonic() >= deadline:
                return False

    def _track(self, message: Message) -> None:
        seq = message.seq
        if self.next_seq is None:
            self.first_seq = seq
        elif seq != self.next_seq:
            self.gaps.append((self.next_seq, seq))
        self.next_seq = seq + 1 if message.kind == "step" else seq
        self.received += 1
        if message.kind == "header":
            self.header = message.payload
        elif message.kind == "end":
            self.ended = True

    def close(self) -> None:
        """Close the socket (pending messages are dropped); idempotent."""
        if not self._closed:
            self._closed = True
            self._socket.close(linger=0)
            self._context.term()

    @property
    def closed(self) -> bool:
        return self._closed

    def __repr__(self) -> str:
        return f"Subscriber({self.endpoint!r}, received={self.received}, gaps={len(self.gaps)})"
