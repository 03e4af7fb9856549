"""In-process, ordered, synchronous event bus.

Every subscriber sees every event in the same global order.  A subscriber that
raises does not stop delivery: the failure is recorded as a
:class:`SubscriberError` in ``bus.errors``, logged at ERROR on the
``kvsched.events.bus`` logger, and returned from the ``publish`` call.

Re-entrancy: an event published from inside a subscriber is queued and
delivered after the current event has reached all subscribers (so ordering
stays global); its errors are returned by the outermost ``publish`` call.
Subscribing or unsubscribing during delivery takes effect from the next event,
except that an unsubscribed callback is never called again.

Not thread-safe: use one bus per thread or guard it externally.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Generic, TypeVar

__all__ = ["EventBus", "SubscriberError", "Subscription"]

E = TypeVar("E")

_logger = logging.getLogger("kvsched.events.bus")


@dataclass(frozen=True, slots=True)
class SubscriberError(Generic[E]):
    """A subscriber raised ``exception`` while handling ``event``."""

    subscriber_name: str
    event: E
    exception: Exception


class Subscription(Generic[E]):
    """Handle returned by :meth:`EventBus.subscribe`."""

    __slots__ = ("_bus", "active", "callback", "name")

    def __init__(self, bus: EventBus[E], callback: Callable[[E], object], name: str) -> None:
        self._bus = bus
        self.callback = callback
        self.name = name
        self.active = True

    def unsubscribe(self) -> None:
        """Stop delivery to this subscriber; idempotent."""
        if self.active:
            self.active = False
            self._bus._remove(self)

    def __repr__(self) -> str:
        state = "active" if self.active else "inactive"
        return f"Subscription({self.name!r}, {state})"


def _default_name(callback: Callable[..., object]) -> str:
    name = getattr(callback, "__qualname__", None)
    return name if isinstance(name, str) else repr(callback)


class EventBus(Generic[E]):
    """Synchronous publish/subscribe with failure isolation between subscribers."""

    def __init__(self) -> None:
        self._subscribers: list[Subscription[E]] = []
        self._pending: deque[E] = deque()
        self._dispatching = False
        self.errors: list[SubscriberError[E]] = []

    def subscribe(
        self, callback: Callable[[E], object], *, name: str | None = None
    ) -> Subscription[E]:
        """Register ``callback``; it is called after all earlier subscribers."""
        sub = Subscription(self, callback, name if name is not None else _default_name(callback))
        self._subscribers.append(sub)
        return sub

    @property
    def subscribers(self) -> list[str]:
        """Names of the active subscribers, in delivery order."""
        return [sub.name for sub in self._subscribers]

    def publish(self, event: E) -> list[SubscriberError[E]]:
        """Deliver ``event`` to every subscriber; return the errors raised."""
        return self.publish_many((event,))

    def publish_many(self, events: Iterable[E]) -> list[SubscriberError[E]]:
        """Deliver each event, in order, to all subscribers; return the errors raised."""
        self._pending.extend(events)
        if self._dispatching:
            return []
        return self._drain()

    def _drain(self) -> list[SubscriberError[E]]:
        errors: list[SubscriberError[E]] = []
        self._dispatching = True
        try:
            while self._pending:
                errors.extend(self._deliver(self._pending.popleft()))
        finally:
            self._dispatching = False
            self._pending.clear()
        return errors

    def _deliver(self, event: E) -> list[SubscriberError[E]]:
        errors: list[SubscriberError[E]] = []
        for sub in tuple(self._subscribers):
            if not sub.active:
                continue
            try:
                sub.callback(event)
            except Exception as exc:
                errors.append(self._record(sub.name, event, exc))
        return errors

    def _record(self, name: str, event: E, exc: Exception) -> SubscriberError[E]:
        error = SubscriberError(name, event, exc)
        self.errors.append(error)
        _logger.error("subscriber %r failed on event %r", name, event, exc_info=exc)
        return error

    def _remove(self, sub: Subscription[E]) -> None:
        self._subscribers = [s for s in self._subscribers if s is not sub]
