"""SessionTable: open chat sessions, their active turn and the blocks they hold.

A session opens with its first turn's arrival and closes with ``SessionClosed``. Between
turns an attention-only model's session holds one reference on the full blocks of its last
turn (``SessionBlocksHeld``), so the next turn hits them; the hold is dropped when the next
turn is admitted, when memory is reclaimed or when the session closes. ``last_used`` is the
step of the session's latest arrival or turn end.

It also keeps each session's history (``History``: every token of its finished turns, their
block digests, namespace root and multimodal spans), which the next turn's arrival
continues: a turn that finishes (or is aborted with ``keep_history``) becomes the history,
read from the sequence table as the turn ends (this owner folds before that table retires
it); ``SessionClosed`` drops it. The sequence table reads the history (``history``), and
never writes it.
"""

from __future__ import annotations

from collections.abc import Callable, ItemsView, Iterator, ValuesView
from typing import TYPE_CHECKING, Any

import attrs
import numpy as np

from kvsched.events import types as ev
from kvsched.reducers.errors import RefChange, ReplayMismatch
from kvsched.reducers.seq import History

if TYPE_CHECKING:
    from kvsched.reducers.sequences import SequenceTable

_NONE = np.zeros(0, dtype=np.int32)


@attrs.define(slots=True)
class Session:
    session_id: int
    held: np.ndarray = _NONE  # blocks this session holds a reference on
    active_seq: int = -1
    last_used: int = 0


class SessionTable:
    def __init__(self) -> None:
        self.sessions: dict[int, Session] = {}
        self._of_seq: dict[int, int] = {}  # active sequence -> its session
        self.step = 0
        self.history: dict[int, History] = {}  # session id -> its finished turns
        self._seqs: SequenceTable | None = None  # read at a turn's end (``bind``)

    def bind(self, seqs: SequenceTable) -> None:
        """The sequence table whose ending turns this table reads (it reads this history)."""
        self._seqs = seqs

    def folds(self) -> dict[type[ev.Event], Callable[[Any], RefChange | None]]:
        return {
            ev.StepStarted: self._on_step_started,
            ev.RequestArrived: self._on_arrived,
            ev.SessionBlocksHeld: self._on_held,
            ev.BlocksFreed: self._on_freed,
            ev.SequenceFinished: self._on_ended,
            ev.SequenceAborted: self._on_ended,
            ev.SessionClosed: self._on_closed,
            ev.Drained: self._on_drained,
        }

    # ------------------------------------------------------------------------- queries

    def get(self, session_id: int) -> Session | None:
        return self.sessions.get(session_id)

    def __getitem__(self, session_id: int) -> Session:
        return self.sessions[session_id]

    def __contains__(self, session_id: object) -> bool:
        return session_id in self.sessions

    def __iter__(self) -> Iterator[int]:
        return iter(self.sessions)

    def __len__(self) -> int:
        return len(self.sessions)

    def values(self) -> ValuesView[Session]:
        return self.sessions.values()

    def items(self) -> ItemsView[int, Session]:
        return self.sessions.items()

    def history_len(self, session_id: int) -> int:
        history = self.history.get(session_id)
        return 0 if history is None else len(history.tokens)

    def holders(self) -> list[np.ndarray]:
        return [s.held for s in self.sessions.values() if len(s.held)]

    @staticmethod
    def holder_id(session_id: int) -> int:
        """The holder id of a session in ``BlocksFreed`` (sequences have ids >= 0)."""
        return -session_id - 1

    # -------------------------------------------------------------------------- folds

    def _on_step_started(self, e: ev.StepStarted) -> None:
        self.step = e.step

    def _session(self, session_id: int) -> Session:
        session = self.sessions.get(session_id)
        if session is None:
            raise ReplayMismatch(f"session {session_id} is not open")
        return session

    def _on_arrived(self, e: ev.RequestArrived) -> None:
        if e.session_id < 0:
            return
        session = self.sessions.setdefault(e.session_id, Session(e.session_id))
        session.active_seq = e.seq_id
        session.last_used = self.step
        self._of_seq[e.seq_id] = e.session_id

    def _on_held(self, e: ev.SessionBlocksHeld) -> None:
        session = self._session(e.session_id)
        if len(session.held):
            raise ReplayMismatch(f"session {e.session_id} already holds blocks")
        session.held = np.array(e.blocks, dtype=np.int32)

    def _on_freed(self, e: ev.BlocksFreed) -> RefChange | None:
        bounds = np.concatenate(([0], np.cumsum(e.counts)))
        released = []
        for i, holder in enumerate(e.seq_ids.tolist()):
            if holder < 0:
                blocks = e.blocks[bounds[i] : bounds[i + 1]]
                session = self._session(-holder - 1)
                if not np.array_equal(session.held, blocks):
                    raise ReplayMismatch(f"session {-holder - 1} does not hold {blocks}")
                session.held = _NONE
                released.append(blocks)
        return RefChange(release=tuple(released)) if released else None

    def _keep_history(self, seq_id: int) -> None:
        """The session continues from this turn: its tokens (outputs included, read without
        flushing the row) and digests."""
        assert self._seqs is not None, "SessionTable.bind(seqs) first"
        seqs = self._seqs
        seq = seqs.seq(seq_id)
        if seq.session_id < 0:
            raise ReplayMismatch(f"sequence {seq_id}: a kept turn outside a session")
        tokens = seqs.tokens_upto(seq, seqs.num_tokens(seq)).copy()
        self.history[seq.session_id] = History(tokens, seq.hashes, seq.root, seq.mm_spans)

    def _on_ended(self, e: ev.SequenceFinished | ev.SequenceAborted) -> None:
        """Each ending sequence's turn ends; a finished turn of a session, or an aborted one
        with ``keep_history``, becomes the session's history."""
        if isinstance(e, ev.SequenceAborted):
            ended = [(e.seq_id, e.keep_history)]
        else:
            ended = [(seq_id, seq_id in self._of_seq) for seq_id in e.seq_ids.tolist()]
        for seq_id, keep in ended:
            if keep:
                self._keep_history(seq_id)
            session_id = self._of_seq.pop(seq_id, None)
            if session_id is not None:
                session = self.sessions[session_id]
                session.active_seq = -1
                session.last_used = self.step

    def _on_closed(self, e: ev.SessionClosed) -> None:
        session = self._session(e.session_id)
        if len(session.held) or session.active_seq >= 0:
            raise ReplayMismatch(f"session {e.session_id} closed while holding resources")
        del self.sessions[e.session_id]
        self.history.pop(e.session_id, None)

    def _on_drained(self, e: ev.Drained) -> None:
        if self.holders():
            raise ReplayMismatch("drained while sessions hold blocks")

    # --------------------------------------------------------------------- invariants

    def check_invariants(self, live_seqs: set[int]) -> str | None:
        """None when consistent, else a description of the first violation."""
        for session in self.sessions.values():
            if session.active_seq >= 0 and session.active_seq not in live_seqs:
                return f"session {session.session_id} points at a retired sequence"
            if session.active_seq >= 0 and self._of_seq.get(session.active_seq) != (
                session.session_id
            ):
                return f"session {session.session_id}: its active turn is not indexed"
        if len(self._of_seq) != sum(s.active_seq >= 0 for s in self.sessions.values()):
            return "the active-turn index has entries of no open session"
        for session_id, history in self.history.items():
            if session_id not in self.sessions:
                return f"history kept for closed session {session_id}"
            if len(history.hashes) > len(history.tokens) // self._block_size():
                return f"session {session_id}: its history has digests past its tokens"
        return None

    def _block_size(self) -> int:
        return 1 if self._seqs is None else self._seqs.block_size

    def snapshot(self) -> tuple[object, ...]:
        sessions = tuple(
            (k, s.held.tobytes(), s.active_seq, s.last_used) for k, s in self.sessions.items()
        )
        history = tuple(
            (k, h.tokens.tobytes(), h.hashes.packed(), h.root) for k, h in self.history.items()
        )
        return sessions, history
