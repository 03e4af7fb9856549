"""Tests for the in-process event bus."""

from __future__ import annotations

import logging

import pytest

from kvsched.events.bus import EventBus, SubscriberError


class Boom(RuntimeError):
    pass


def test_each_event_reaches_subscribers_in_subscription_order() -> None:
    bus: EventBus[int] = EventBus()
    seen: list[tuple[str, int]] = []
    bus.subscribe(lambda e: seen.append(("a", e)))
    bus.subscribe(lambda e: seen.append(("b", e)))

    bus.publish(1)
    bus.publish(2)

    assert seen == [("a", 1), ("b", 1), ("a", 2), ("b", 2)]


def test_publish_many_delivers_event_major_order() -> None:
    bus: EventBus[str] = EventBus()
    seen: list[str] = []
    bus.subscribe(lambda e: seen.append("a" + e))
    bus.subscribe(lambda e: seen.append("b" + e))

    assert bus.publish_many(["1", "2", "3"]) == []

    assert seen == ["a1", "b1", "a2", "b2", "a3", "b3"]


def test_raising_subscriber_is_reported_and_others_still_called(
    caplog: pytest.LogCaptureFixture,
) -> None:
    bus: EventBus[int] = EventBus()
    seen: list[tuple[str, int]] = []
    bus.subscribe(lambda e: seen.append(("before", e)))

    def explode(event: int) -> None:
        raise Boom(f"bad {event}")

    bus.subscribe(explode, name="exploder")
    bus.subscribe(lambda e: seen.append(("after", e)))

    with caplog.at_level(logging.ERROR, logger="kvsched.events.bus"):
        errors = bus.publish_many([1, 2])

    assert seen == [("before", 1), ("after", 1), ("before", 2), ("after", 2)]
    assert [(e.subscriber_name, e.event) for e in errors] == [("exploder", 1), ("exploder", 2)]
    assert all(isinstance(e.exception, Boom) for e in errors)
    assert bus.errors == errors
    records = [r for r in caplog.records if r.name == "kvsched.events.bus"]
    assert len(records) == 2
    assert all(r.levelno == logging.ERROR and r.exc_info for r in records)
    assert "exploder" in records[0].getMessage()
    assert "Boom: bad 1" in caplog.text  # traceback is included


def test_publish_returns_only_errors_of_that_call_while_bus_keeps_all() -> None:
    bus: EventBus[int] = EventBus()

    def fail_on_odd(event: int) -> None:
        if event % 2:
            raise ValueError(event)

    bus.subscribe(fail_on_odd, name="odd")

    first = bus.publish(1)
    second = bus.publish(2)
    third = bus.publish(3)

    assert [e.event for e in first] == [1]
    assert second == []
    assert [e.event for e in third] == [3]
    assert [e.event for e in bus.errors] == [1, 3]
    assert isinstance(first[0], SubscriberError)


def test_unsubscribed_callback_receives_no_further_events() -> None:
    bus: EventBus[int] = EventBus()
    seen_a: list[int] = []
    seen_b: list[int] = []
    sub_a = bus.subscribe(seen_a.append, name="a")
    bus.subscribe(seen_b.append, name="b")

    bus.publish(1)
    sub_a.unsubscribe()
    sub_a.unsubscribe()  # idempotent
    bus.publish(2)

    assert seen_a == [1]
    assert seen_b == [1, 2]
    assert bus.subscribers == ["b"]
    assert not sub_a.active


def test_unsubscribe_during_delivery_stops_later_subscriber_for_that_event() -> None:
    bus: EventBus[int] = EventBus()
    seen: list[int] = []
    later = None

    def first(event: int) -> None:
        assert later is not None
        later.unsubscribe()

    bus.subscribe(first)
    later = bus.subscribe(seen.append)

    bus.publish(1)

    assert seen == []


def test_event_published_from_subscriber_is_delivered_after_current_event() -> None:
    bus: EventBus[str] = EventBus()
    seen: list[str] = []

    def echo(event: str) -> None:
        seen.append("echo:" + event)
        if event == "x":
            bus.publish("y")

    bus.subscribe(echo)
    bus.subscribe(lambda e: seen.append("log:" + e))

    bus.publish("x")

    assert seen == ["echo:x", "log:x", "echo:y", "log:y"]


def test_default_subscriber_name_is_callback_qualname() -> None:
    bus: EventBus[int] = EventBus()

    def handler(event: int) -> None:
        raise KeyError(event)

    bus.subscribe(handler)
    (error,) = bus.publish(5)

    assert error.subscriber_name.endswith("handler")
