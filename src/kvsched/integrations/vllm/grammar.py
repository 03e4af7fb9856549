"""Structured outputs under kvsched: requests wait for their grammar, rows sample under it.

vLLM compiles a request's grammar in the background (``StructuredOutputManager.grammar_init``,
before ``add_request``). Its own scheduler keeps such a request in
``WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR`` until the compilation ends. The adapter holds it
here instead and gives it to kvsched only once its grammar is ready: that step's
``RequestArrived``. kvsched's log therefore records a request when it became schedulable, and
kvsched never plans a request that cannot sample. A grammar that fails to compile ends its
request with an error, as in vLLM, and kvsched never sees that request.

For each step, ``bitmask`` gives the model runner the grammar bitmask of the structured rows
that sample (vLLM's ``get_grammar_bitmask``: with speculative decoding, one row per verified
draft and one more), and ``accept`` advances a request's grammar by the tokens it kept.
``validate`` keeps the drafts proposed for a structured request up to the first its grammar
rejects (vLLM's ``update_draft_token_ids``).
"""

from __future__ import annotations

from typing import Any

from vllm.v1.core.sched.output import GrammarOutput
from vllm.v1.request import Request, RequestStatus

__all__ = ["Grammars"]


class Grammars:
    """The requests whose grammar is still compiling, and the structured rows of a step."""

    def __init__(self, manager: Any) -> None:
        self.manager = manager  # vLLM's StructuredOutputManager (compiles, fills bitmasks)
        self.waiting: dict[str, Request] = {}  # by vLLM name, in arrival order

    def hold(self, request: Request) -> None:
        request.status = RequestStatus.WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR
        self.waiting[request.request_id] = request

    def drop(self, name: str) -> Request | None:
        """Forget a request finished before its grammar was ready (vLLM's abort)."""
        return self.waiting.pop(name, None)

    def settle(self) -> tuple[list[Request], list[tuple[Request, str]]]:
        """(requests whose grammar is now ready, in arrival order; requests whose grammar
        failed to compile, with the reason). Both leave the waiting set."""
        ready: list[Request] = []
        failed: list[tuple[Request, str]] = []
        for name, request in list(self.waiting.items()):
            structured = request.structured_output_request
            grammar = structured.grammar if structured is not None else None
            if grammar is None:
                continue  # still compiling
            del self.waiting[name]
            if isinstance(grammar, Exception):
                failed.append((request, f"structured output grammar failed: {grammar}"))
            else:
                request.status = RequestStatus.WAITING
                ready.append(request)
        return ready, failed

    @staticmethod
    def rows(so: Any, plan: Any, ahead: Any, structured: Any, req_of: dict[int, Any]) -> list[str]:
        """The structured rows of ``plan`` that sample (``get_grammar_bitmask``'s), by name;
        flags them on the ``SchedulerOutput`` ``so``, and, as vLLM's AsyncScheduler does,
        flags pending tokens when one of them has tokens still out (``ahead``, per row):
        the bitmask then waits until they are in."""
        out = dict(zip(plan.seq_ids.tolist(), ahead.tolist(), strict=True))
        rows = [i for i in plan.seq_ids[plan.sample].tolist() if i in structured]
        so.has_structured_output_requests = bool(rows)
        so.pending_structured_output_tokens = any(out[i] > 0 for i in rows)
        return [req_of[i].request_id for i in rows]

    def bitmask(
        self, requests: dict[str, Request], names: list[str], spec: dict[str, list[int]]
    ) -> GrammarOutput | None:
        """The bitmask of the structured rows that sample this step (``names``; those no
        longer in ``requests`` are left out: a deferred bitmask comes after the output
        before it, which may have ended some; ``spec``: the drafts each verifies), or None
        when there are none."""
        names = [name for name in names if name in requests]
        if not names:
            return None
        mask = self.manager.grammar_bitmask(requests, names, spec)
        return GrammarOutput(names, mask, [_kept(spec.get(name, ())) for name in names])

    def proposals(
        self, proposed: Any, requests: dict[str, Request], seq_of: dict[str, int]
    ) -> dict[int, list[int]]:
        """The runner's ``proposed`` drafts (vLLM's ``DraftTokenIds``) by sequence id, of the
        requests still live; a structured request's only up to the first its grammar
        rejects (as vLLM's ``update_draft_token_ids``)."""
        out = {}
        for name, ids in zip(proposed.req_ids, proposed.draft_token_ids, strict=True):
            request = requests.get(name)
            if ids and request is not None and name in seq_of:
                ids = list(ids)
                out[seq_of[name]] = (
                    self.validate(request, ids) if request.use_structured_output else ids
                )
        return out

    def check_drafts(self, requests: dict[str, Request], proposed: Any, so: Any) -> None:
        """vLLM's ``update_draft_token_ids_in_output`` (async scheduling, a structured step
        whose bitmask waited for the output before it): each scheduled row's placeholder
        drafts become the runner's ``proposed`` ones, cut where a structured request's grammar
        rejects them and padded with -1 to the number scheduled (``num_invalid_spec_tokens``
        counts the padding)."""
        spec, invalid = so.scheduled_spec_decode_tokens, {}
        for name, ids in zip(proposed.req_ids, proposed.draft_token_ids, strict=True):
            request, scheduled = requests.get(name), spec.get(name)
            if request is None or not scheduled:
                continue
            ids = list(ids)[: len(scheduled)]
            if request.use_structured_output:
                ids = self.validate(request, ids)
            if len(ids) < len(scheduled):
                invalid[name] = len(scheduled) - len(ids)
                ids += [-1] * invalid[name]
            spec[name] = ids
        so.num_invalid_spec_tokens = invalid

    def accept(self, request: Request, tokens: list[int]) -> bool:
        """Advance the request's grammar by ``tokens``; False if the grammar rejects them."""
        return bool(self.manager.accept_tokens(request, tokens))

    def validate(self, request: Request, drafts: list[int]) -> list[int]:
        """The drafts up to the first the request's grammar rejects."""
        valid: list[int] = self.manager.validate_tokens(request, drafts)
        return valid


def _kept(drafts: Any) -> int:
    """Drafts before the first -1 (padding: placeholders, or ones the grammar cut)."""
    return next((i for i, t in enumerate(drafts) if t < 0), len(drafts))
