"""SaveQueue: the checkpoints reserved but not yet published, by the step that saves them
(``CheckpointTable`` owns one and calls it from its folds).

A save reserved while step N is scheduled is written by N's forward, so it is published once
N's outcome lands, or abandoned if N fails. With overlapped steps (``speculation.pipelined``)
N's outcome lands in step N+1 or N+2, and two launched steps can await their outcomes at
once: each keeps its own reservations, so an outcome publishes exactly the saves of its own
step, and a reservation is never dropped by a step that brings no outcome.
"""

from __future__ import annotations


class SaveQueue:
    def __init__(self) -> None:
        self.step = 0  # the step being scheduled
        self.reserved: list[int] = []  # what it reserved
        self.reserved_keys: dict[bytes, int] = {}  # their identities
        self.awaiting: dict[int, list[int]] = {}  # launched step -> what it reserved

    def start(self, step: int) -> None:
        """Step ``step`` starts: the step before it is launched with its reservations."""
        if self.reserved:
            self.awaiting.setdefault(self.step, []).extend(self.reserved)
        self.step, self.reserved, self.reserved_keys = step, [], {}

    def reserve(self, ckpt_id: int, key: bytes) -> None:
        self.reserved.append(ckpt_id)
        self.reserved_keys[key] = ckpt_id

    def awaiting_ids(self, step: int | None = None) -> list[int]:
        """What launched ``step`` reserved (None: every launched step), a copy."""
        if step is not None:
            return list(self.awaiting.get(step, ()))
        return [i for ids in self.awaiting.values() for i in ids]

    def launched(self, ckpt_id: int) -> bool:
        """Whether ``ckpt_id`` was reserved by a launched step (it may be published)."""
        return any(ckpt_id in ids for ids in self.awaiting.values())

    def remove(self, ckpt_id: int, key: bytes) -> None:
        """``ckpt_id`` (identity ``key``) is published or dropped: off every queue."""
        if ckpt_id in self.reserved:
            self.reserved.remove(ckpt_id)
        for step, ids in list(self.awaiting.items()):
            if ckpt_id in ids:
                ids.remove(ckpt_id)
                if not ids:
                    del self.awaiting[step]
        if self.reserved_keys.get(key) == ckpt_id:
            del self.reserved_keys[key]

    def problem(self, reserved: dict[int, bytes]) -> str | None:
        """None when the queues hold exactly the ``reserved`` checkpoints (id -> identity),
        each once, and the identity index is this step's reservations; else the first
        violation."""
        queued = self.reserved + self.awaiting_ids()
        stale = sorted(set(queued) - set(reserved))
        if stale:
            return f"checkpoints {stale} await publication but are not reserved"
        lost = sorted(set(reserved) - set(queued))
        if lost or len(queued) != len(set(queued)) or [] in self.awaiting.values():
            return f"checkpoints {lost} are reserved by no step (or queued twice)"
        if self.reserved_keys != {reserved[i]: i for i in self.reserved}:
            return "the reserved-identity index is not the keys of this step's reservations"
        return None

    def snapshot(self) -> tuple[object, ...]:
        awaiting = tuple((step, tuple(ids)) for step, ids in sorted(self.awaiting.items()))
        return self.step, tuple(self.reserved), awaiting
