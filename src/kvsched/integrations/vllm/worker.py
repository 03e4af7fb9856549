"""``WorkerView``: what vLLM's model runner holds of each request, and the per-request part of
a ``SchedulerOutput`` that follows from it.

vLLM's runner keeps a request's block table between steps and only ever appends to it; it
drops from its batch the requests a step does not schedule (they come back with all their
tokens, ``CachedRequestData.all_token_ids``), and a preempted request comes back with its
whole table (``resumed_req_ids``). This class owns that knowledge: the blocks sent per
sequence, the preempted ones, and the names the last step scheduled.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from vllm.v1.core.sched.output import CachedRequestData, NewRequestData
from vllm.v1.request import RequestStatus

from kvsched.integrations.vllm.mamba import GroupTables
from kvsched.plan import StepPlan


class WorkerView:
    def __init__(self, tables: GroupTables) -> None:
        self._tables = tables
        self._sent: dict[int, int] = {}  # blocks the worker holds per sequence; absent: new
        self._resumed: set[int] = set()  # preempted: the worker gets its whole table again
        self._prev: Any = set()  # names scheduled in the last step

    def step(
        self, plan: StepPlan, req_of: dict[int, Any], placeholders: np.ndarray
    ) -> tuple[list[NewRequestData], CachedRequestData, dict[str, int]]:
        """The plan's rows as vLLM's new and cached request data, and the tokens scheduled
        per name; each request's ``num_computed_tokens`` becomes its row's end.
        ``placeholders``: each row's tokens still out (overlapped steps), which vLLM counts
        in a cached request's ``num_output_tokens`` (its runner cuts its own token list to
        that count)."""
        new_reqs, cached = [], CachedRequestData.make_empty()
        num_scheduled: dict[str, int] = {}
        tables, sent_of, prev, resumed = plan.block_tables, self._sent, self._prev, self._resumed
        running = RequestStatus.RUNNING
        req_ids, new_block_ids = cached.req_ids, cached.new_block_ids
        computed, num_output = cached.num_computed_tokens, cached.num_output_tokens
        group_ids = self._tables.ids
        restore = dict(plan.state_restore[:, ::-1].tolist()) if len(plan.state_restore) else {}
        runtime = plan.state_slots.tolist()
        rows = zip(
            plan.seq_ids.tolist(),
            plan.starts.tolist(),
            plan.ends.tolist(),
            plan.num_blocks.tolist(),
            placeholders.tolist(),
            strict=True,
        )
        for i, (seq_id, start, end, n, out) in enumerate(rows):
            request = req_of[seq_id]
            name = request.request_id
            sent = sent_of.get(seq_id)
            if sent is None:  # new to the worker: its whole table, the hit as computed
                request.status = running
                request.num_computed_tokens = start
                ids = group_ids(tables[i, :n].tolist(), start, end, 0, runtime[i], restore)
                new_reqs.append(NewRequestData.from_request(request, ids))
            else:
                new: tuple[list[int], ...] | None = None
                if seq_id in resumed:  # after a preemption: the whole table again
                    request.status = running
                    resumed.discard(seq_id)
                    cached.resumed_req_ids.add(name)
                    new = group_ids(tables[i, :n].tolist(), start, end, 0, runtime[i], restore)
                elif n > sent:  # running: only the blocks appended since its last table
                    new = group_ids(tables[i, sent:n].tolist(), start, end, sent, runtime[i], {})
                if name not in prev:  # (vLLM sends these for requests absent from the last step)
                    cached.all_token_ids[name] = request.all_token_ids.copy()  # (as vLLM)
                req_ids.append(name)
                new_block_ids.append(new)
                computed.append(start)
                num_output.append(request.num_output_tokens + out)
            sent_of[seq_id] = n
            num_scheduled[name] = end - start
            request.num_computed_tokens = end
        self._prev = num_scheduled.keys()
        return new_reqs, cached, num_scheduled

    def empty_step(self) -> None:
        """A step that scheduled nothing: the runner drops every request from its batch."""
        self._prev = set()

    def preempted(self, seq_id: int) -> None:
        """A preempted sequence the worker has seen gets its whole table when resumed."""
        if seq_id in self._sent:
            self._resumed.add(seq_id)

    def forget(self, seq_id: int) -> None:
        """A retired sequence."""
        self._sent.pop(seq_id, None)
        self._resumed.discard(seq_id)
