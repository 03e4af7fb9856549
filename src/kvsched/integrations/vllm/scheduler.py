"""``kvsched.integrations.vllm.Scheduler``: kvsched as vLLM's scheduler (vLLM 0.32.0).

    LLM(model, scheduler_cls="kvsched.integrations.vllm.Scheduler", ...)
    vllm serve MODEL --scheduler-cls kvsched.integrations.vllm.Scheduler

One vLLM engine step is one kvsched step:

    add_request / finish_requests   -> RequestArrived / RequestAborted  (next step's inputs)
    schedule()                      -> Engine.step(inputs) -> SchedulerOutput
    update_from_output(so, output)  -> StepExecuted (next step's input) + EngineCoreOutputs

kvsched's block pool owns every block id of vLLM's KV cache (``KVCacheConfig.num_blocks``,
block 0 the null block); vLLM's ``KVCacheManager`` is never created. vLLM learns a finish in
``update_from_output`` (its stop rule, ``requests.stop_reason``); kvsched folds the same token
at the next step and must retire the same requests, which is checked.
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict, deque
from collections.abc import Iterable
from functools import partial
from operator import itemgetter
from typing import Any

import msgspec
import numpy as np
from vllm.distributed.kv_events import (
    KVEventBatch,
)
from vllm.v1.core.sched.interface import PauseState, SchedulerInterface
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.engine import EngineCoreOutputs
from vllm.v1.metrics.stats import PrefixCacheStats
from vllm.v1.request import Request, RequestStatus

from kvsched.engine import StepResult
from kvsched.events import types as ev
from kvsched.integrations.vllm import config as cfg
from kvsched.integrations.vllm import connector, drafts, startup
from kvsched.integrations.vllm.encoders import EncoderInputs
from kvsched.integrations.vllm.grammar import Grammars
from kvsched.integrations.vllm.mamba import GroupTables
from kvsched.integrations.vllm.mamba import layout as mamba_layout
from kvsched.integrations.vllm.outputs import (
    NO_PROMPT,
    AdapterMismatch,
    check_plan,
    error_output,
    kv_events,
    preempt,
    token_output,
)
from kvsched.integrations.vllm.queries import Queries
from kvsched.integrations.vllm.requests import Registry, refusal, stop_reason
from kvsched.integrations.vllm.worker import WorkerView

logger = logging.getLogger(__name__)

# A step out: its result, the requests retired since (by sequence id: their tokens in it are
# dropped), and when each row that samples took its row (its outputs go back in that order).
Awaiting = tuple[StepResult, dict[int, str], np.ndarray]
_NO_LOGPROBS: tuple[Any, tuple[Any, Any]] = (None, NO_PROMPT)

_STATUS = {
    "stop": RequestStatus.FINISHED_STOPPED,
    "stop_token": RequestStatus.FINISHED_STOPPED,
    "length": RequestStatus.FINISHED_LENGTH_CAPPED,
    "error": RequestStatus.FINISHED_ERROR,  # (a token its grammar rejects)
}


class Scheduler(Queries, SchedulerInterface):  # type: ignore[misc]  # (vLLM is untyped here)
    def __init__(
        self,
        vllm_config: Any,
        kv_cache_config: Any,
        structured_output_manager: Any,
        block_size: int,
        hash_block_size: int | None = None,
        mm_registry: Any = None,
        include_finished_set: bool = False,
        log_stats: bool = False,
    ) -> None:
        self.vllm_config = vllm_config
        self.kv_cache_config = kv_cache_config
        self.log_stats = log_stats
        self.ec_connector = None
        opts, self.config, self.engine, encoder_cache = startup.start(
            vllm_config, kv_cache_config, block_size, mm_registry
        )
        self.encoders = EncoderInputs(encoder_cache)  # (multimodal models: vLLM's encoder cache)
        self.log_path: str | None = opts.get("log")
        self.max_model_len = self.config.model.max_context
        attn_group, mamba_groups = cfg.groups(kv_cache_config)
        num_ids = kv_cache_config.num_blocks
        self.mamba = mamba_layout(self.config, mamba_groups, block_size, num_ids)
        self.kv = connector.create(vllm_config, kv_cache_config, block_size, self.mamba)
        self.connector = self.kv.connector if self.kv else None  # (vLLM's engine reads it)
        num_groups = len(kv_cache_config.kv_cache_groups)
        self.worker = WorkerView(GroupTables(attn_group, mamba_groups, num_groups, self.mamba))
        self._zeroing = bool(getattr(kv_cache_config, "needs_kv_cache_zeroing", False))
        self._fresh_blocks: list[int] = []
        self.clock0 = time.monotonic()
        self._pause = PauseState.UNPAUSED
        # request bookkeeping (vLLM names are strings, kvsched ids integers)
        self.requests: dict[str, Request] = {}  # unfinished, as vLLM sees them
        self.reg = Registry(self.max_model_len, time.time(), opts.get("block_hashes") == "vllm")
        self.grammars = Grammars(structured_output_manager)
        self._grammar_rows: list[str] = []  # the last step's structured rows that sample
        self._inputs: list[ev.Event] = []  # the next step's inputs (outcome first)
        self._finished_ids: set[str] = set()  # for the next SchedulerOutput
        self._expected: dict[int, str] = {}  # finishes vLLM reported, kvsched retires next
        self._errors: list[tuple[Request, str]] = []  # refused: reported at the next update
        # Steps scheduled whose output vLLM has not given back, oldest first (None: an empty
        # step, scheduled while an earlier one was out; a preempted sequence's tokens are
        # delivered, as vLLM's async scheduler does, and kvsched appends them too).
        self._awaiting: deque[Awaiting | None] = deque()
        self.num_drafts = cfg.num_drafts(vllm_config)  # speculative decoding (0: off)
        self._prefix_stats = PrefixCacheStats()
        self._events: list[Any] = []
        self._kv_events, self._publish, self.kv_event_publisher = kv_events(
            vllm_config, kv_cache_config, block_size
        )
        logger.info("kvsched scheduler: %s; event log: %s", self.config, self.log_path)

    # ------------------------------------------------------------------ requests in

    def add_request(self, request: Request) -> None:
        name = request.request_id
        if name in self.requests:
            raise cfg.UnsupportedConfig(f"request {name}: resumable (streaming) requests")
        reason = refusal(request)
        if reason is not None:
            logger.warning("kvsched refuses request %s: %s", name, reason)
            request.status = RequestStatus.FINISHED_ERROR
            self._errors.append((request, reason))
            return
        self.requests[name] = request
        if request.use_structured_output:
            self.grammars.hold(request)  # (kvsched gets it once its grammar is compiled)
        else:
            self._inputs.append(self.reg.arrive(request))

    def finish_requests(
        self, request_ids: str | Iterable[str] | None, finished_status: Any
    ) -> list[Any]:
        assert RequestStatus.is_finished(finished_status)
        if request_ids is None:
            names = list(self.requests)
        else:
            names = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        done = []
        for name in names:
            request = self.requests.pop(name, None)
            if request is None:
                continue
            request.status = finished_status
            if self.grammars.drop(name) is None:  # (one still compiling: kvsched never saw it)
                seq_id = self.reg.seq_of[name]
                if self.kv:
                    self.kv.finished(request, seq_id, self._computed(request))
                self._inputs.append(ev.RequestAborted(seq_id, "vllm finish_requests"))
            done.append(request)
        return done

    # ------------------------------------------------------------------ one step

    def schedule(self, throttle_prefills: bool = False) -> SchedulerOutput:
        """One kvsched step as vLLM's ``SchedulerOutput``. Under vLLM's async scheduling (step
        N+1 scheduled before step N's output is given back) kvsched plans N+1 while N runs
        (overlapped steps, ``speculation.pipelined``; drafts verified then are placeholders,
        -1, as vLLM's; a structured row with tokens still out gets its bitmask once they
        are back: ``pending_structured_output_tokens``)."""
        out = sum(r is not None for r in self._awaiting)
        if out and (out > 1 or not self.config.speculation.pipelined):
            self._awaiting.append(None)
            self.worker.empty_step()
            self.encoders.empty_step()
            return SchedulerOutput.make_empty()
        if self.grammars.waiting:
            self._settle_grammars()
        inputs, self._inputs = self._inputs, []
        if self.kv:  # (lookup answers, loads that ended)
            inputs += self.kv.inputs(self.reg.req_of)
        port = partial(self.kv.answer, req_of=self.reg.req_of) if self.kv else None
        result = self.engine.step(inputs, time.monotonic() - self.clock0, port)
        entries = self.engine.state.seqs.entries_of(result.plan.seq_ids[result.plan.sample])
        self._awaiting.append((result, {}, entries))
        preempted = self._fold_decisions(result)
        plan = result.plan
        check_plan(plan)
        if self.mamba is not None:  # (state saves relabel blocks: MambaLayout.relabel)
            self.mamba.relabel(plan.state_save_before, self.engine.check)
        out_ids = self.engine.state.seqs.placeholders_of(plan.seq_ids)
        new_reqs, cached, num_scheduled = self.worker.step(plan, self.reg.req_of, out_ids)
        if self.mamba is not None:
            self.mamba.relabel(plan.state_save, self.engine.check)
        out = SchedulerOutput(
            scheduled_new_reqs=new_reqs,
            scheduled_cached_reqs=cached,
            num_scheduled_tokens=num_scheduled,
            total_num_scheduled_tokens=plan.num_tokens,
            scheduled_spec_decode_tokens=drafts.scheduled_drafts(plan, self._name_of),
            scheduled_encoder_inputs=self.encoders.schedule(plan, self.reg.req_of),
            finished_req_ids=self._finished_ids,
            free_encoder_mm_hashes=self.encoders.freed(),
            preempted_req_ids=preempted,
            new_block_ids_to_zero=self._fresh_blocks if self._zeroing else None,
            num_spec_tokens_to_schedule=self.num_drafts,  # (the runner proposes this many)
        )
        if self.reg.structured:  # (get_grammar_bitmask's rows)
            structured, req_of = self.reg.structured, self.reg.req_of
            self._grammar_rows = Grammars.rows(out, plan, out_ids, structured, req_of)
        if self.kv:  # (last: build_connector_meta reads the step's whole output)
            self.kv.after_step(result.decisions, self.reg.req_of, self._blocks_of)
            self.kv.meta(out, lambda name: (self._blocks_of(self.reg.seq_of[name]),))
        self._fresh_blocks = []
        self._finished_ids = set()
        return out

    def _connector_landed(self, kv: connector.Bridge, report: Any) -> None:
        """The connector's worker report; under vLLM's ``kv_load_failure_policy`` "fail" a
        request whose load failed ends in error (kvsched aborts it)."""
        kv.landed(report)
        for seq_id, reason in kv.take_failed():
            request = self.requests.pop(self.reg.req_of[seq_id].request_id, None)
            if request is None:
                continue  # (aborted meanwhile: its abort is kvsched's input already)
            request.status = RequestStatus.FINISHED_ERROR
            self._errors.append((request, reason))
            self._inputs.append(ev.RequestAborted(seq_id, reason))
        self._events += kv.events() if self._publish else []

    def _name_of(self, seq_id: int) -> str:
        return str(self.reg.req_of[seq_id].request_id)

    def _fold_decisions(self, result: StepResult) -> set[str]:
        """What this step's decisions mean for vLLM's side; returns the preempted names."""
        preempted: set[str] = set()
        if self._publish:
            self._events += self._kv_events.translate(result.decisions, self.reg.req_of.__getitem__)
        for d in result.decisions:
            if isinstance(d, ev.SequenceFinished):
                self._check_cached(
                    d.seq_ids.tolist(), d.cached_local, d.cached_checkpoint, d.cached_external
                )
                for seq_id, reason in zip(d.seq_ids.tolist(), d.reasons, strict=True):
                    self._retire(seq_id, reason)
            elif isinstance(d, ev.SequenceAborted):
                self._check_cached(
                    [d.seq_id], [d.cached_local], [d.cached_checkpoint], [d.cached_external]
                )
                self._retire(d.seq_id, "aborted")
            elif isinstance(d, ev.RequestRejected):
                request = self.reg.forget(d.seq_id)
                self.requests.pop(request.request_id, None)
                request.status = RequestStatus.FINISHED_ERROR
                self._errors.append((request, d.reason))
            elif isinstance(d, ev.SequencePreempted):
                request = preempt(self.reg.req_of[d.seq_id])
                self.worker.preempted(d.seq_id)
                self.encoders.drop(request)
                preempted.add(request.request_id)
            elif isinstance(d, ev.BlocksAllocated) and self._zeroing:
                self._fresh_blocks += d.blocks.tolist()
            elif isinstance(d, ev.PrefixMatched) and d.num_query_tokens:
                self._prefix_stats.record(d.num_query_tokens, d.num_tokens, False)
                self._cached_tokens(d.seq_id)
            elif isinstance(d, ev.KVLoadSettled):
                self._cached_tokens(d.seq_id, settled=True)
        if self._expected:
            raise AdapterMismatch(
                f"vLLM finished {sorted(self._expected.values())} but kvsched did not"
            )
        return preempted

    def _cached_tokens(self, seq_id: int, settled: bool = False) -> None:
        """vLLM's ``num_cached_tokens`` (and ``PrefillStats``): the sequence's cached-token
        counts as its ``SequenceFinished`` reports them (a load's once it settles); with a
        connector, its prefix-cache counts (a load's once it settles, as vLLM's)."""
        request = self.reg.req_of[seq_id]
        local, ckpt, external = self.engine.state.seq(seq_id).cached_tokens
        self.reg.cached[seq_id] = local + ckpt + external
        if request.prefill_stats is not None:
            request.prefill_stats.set(request.num_prompt_tokens, local + ckpt, external)
        if self.kv is None:
            return
        load = self.engine.state.transfers.load_of(seq_id)
        if settled or load is None or not load.admitted:
            queries = request.num_tokens - local - ckpt
            self.kv.prefix_stats.record(queries, external, request.num_preemptions > 0)

    def _settle_grammars(self) -> None:
        """Requests whose grammar is compiled go to kvsched; a failed one ends in error."""
        ready, failed = self.grammars.settle()
        for request in ready:
            self._inputs.append(self.reg.arrive(request))
        for request, reason in failed:
            del self.requests[request.request_id]
            request.status = RequestStatus.FINISHED_ERROR
            self._errors.append((request, reason))

    def get_grammar_bitmask(self, scheduler_output: Any) -> Any:
        if not scheduler_output.has_structured_output_requests:
            return None
        spec = scheduler_output.scheduled_spec_decode_tokens
        return self.grammars.bitmask(self.requests, self._grammar_rows, spec)

    def _check_cached(self, seq_ids: list[int], *counts: Any) -> None:
        if self.config.legacy.report_cached_tokens:
            mismatch = self.reg.cached_mismatch(seq_ids, *counts)
            if mismatch:
                raise AdapterMismatch(mismatch)

    def _retire(self, seq_id: int, reason: str) -> None:
        request = self.reg.forget(seq_id)
        for out in filter(None, self._awaiting):  # (its token in a step still out: dropped)
            out[1][seq_id] = request.request_id
        expected = self._expected.pop(seq_id, None)
        if reason != "aborted" and expected is None:
            raise AdapterMismatch(f"kvsched finished {request.request_id} ({reason}); vLLM did not")
        self.worker.forget(seq_id)
        self.encoders.drop(request)
        self._finished_ids.add(request.request_id)

    # ------------------------------------------------------------------ outcome

    def update_from_output(self, scheduler_output: Any, model_runner_output: Any) -> dict[Any, Any]:
        outputs: dict[int, list[Any]] = defaultdict(list)
        if not self._awaiting:
            raise AdapterMismatch("update_from_output for a step kvsched did not schedule")
        step = self._awaiting.popleft()
        self.encoders.landed()
        if step is not None:
            self._record_outcome(step, model_runner_output, outputs)
        elif model_runner_output.sampled_token_ids:
            raise AdapterMismatch("tokens sampled in a step kvsched scheduled empty")
        for request, reason in self._errors:
            outputs[request.client_index].append(error_output(request, reason))
        self._errors = []
        if self.kv:
            self._connector_landed(self.kv, model_runner_output.kv_connector_output)
        if self._events:
            self.kv_event_publisher.publish(KVEventBatch(ts=time.time(), events=self._events))
            self._events = []
        result = {client: EngineCoreOutputs(outputs=outs) for client, outs in outputs.items()}
        stats = self.make_stats()
        if stats is not None:
            result.setdefault(0, EngineCoreOutputs()).scheduler_stats = stats
        return result

    def _record_outcome(self, step: Awaiting, mro: Any, outputs: dict[int, list[Any]]) -> None:
        """Each sampled token: into the next step's ``StepExecuted`` and, unless its request
        was aborted or retired meanwhile, onto the vLLM request with an output (and vLLM's
        stop rule); the outputs in the order the rows were taken, as vLLM's follow its
        running list (an ``n > 1`` request's ``num_cached_tokens`` is its last output's, in
        vLLM's front end)."""
        plan, left, entries = step[0].plan, step[1], step[2]
        if plan.is_empty:
            return
        ordered: list[tuple[int, int, Any]] = []  # (row taken, client, output)
        sampled, index = mro.sampled_token_ids, mro.req_id_to_index
        req_of, requests = self.reg.req_of, self.requests
        with_logprobs = mro.logprobs is not None or _has_prompt_logprobs(mro)  # (rare)
        seq_ids = plan.seq_ids[plan.sample]
        stops, structured = self.reg.stops, self.reg.structured
        tokens: list[int] = []
        counts: list[int] = []  # (in the event only when drafts were verified)
        todo = zip(seq_ids.tolist(), drafts.most_tokens(plan), entries.tolist(), strict=False)
        for seq_id, most, entry in todo:
            name = left.get(seq_id) or req_of[seq_id].request_id
            got: Any = sampled[index[name]] if sampled else ()
            if not 0 < len(got) <= most:
                raise AdapterMismatch(f"{name}: {len(got)} tokens, kvsched expects 1..{most}")
            if name not in requests or seq_id in left:  # (aborted or finished after it was
                # scheduled: folded, and dropped by kvsched too)
                tokens += got
                counts.append(len(got))
                continue
            request = req_of[seq_id]
            request.num_computed_tokens -= most - len(got)  # (the rejected drafts)
            stop = None
            for n, token in enumerate(got, 1):  # vLLM's stop rule after each token
                request.append_output_token_ids(token)
                stop = stop_reason(stops[seq_id], token, request.num_output_tokens)
                if stop is not None:
                    got = got[:n]  # (the tokens after the one that ends it are dropped)
                    break
            if seq_id in structured and not self.grammars.accept(request, got):
                stop = ("error", None)  # (as vLLM: never, under the bitmask it was given)
            tokens += got
            counts.append(len(got))
            finish = None if stop is None else self._finish(request, seq_id, *stop)
            more = _logprobs(mro, request, name, len(got)) if with_logprobs else _NO_LOGPROBS
            output = token_output(request, got, finish, *more)
            if finish is not None and self.kv:
                blocks = self._computed(request)
                output.kv_transfer_params = self.kv.finished(request, seq_id, blocks)
            ordered.append((entry, request.client_index, output))
        for _, client, output in sorted(ordered, key=itemgetter(0)):
            outputs[client].append(output)
        executed = ev.StepExecuted(plan.step, seq_ids.copy(), np.asarray(tokens, dtype=np.int32))
        if len(plan.num_drafts):
            executed = msgspec.structs.replace(executed, counts=np.asarray(counts, np.int32))
        self._inputs.insert(0, executed)

    def update_draft_token_ids(self, draft_token_ids: Any) -> None:
        """The drafts vLLM's runner proposed after the last step: into that step's outcome,
        for kvsched to fold with it (only rows that sampled, and requests still live)."""
        if not self._inputs or not isinstance(self._inputs[0], ev.StepExecuted):
            return
        proposed = self.grammars.proposals(draft_token_ids, self.requests, self.reg.seq_of)
        self._inputs[0] = drafts.with_proposals(self._inputs[0], proposed)

    def update_draft_token_ids_in_output(self, draft_token_ids: Any, scheduler_output: Any) -> None:
        """(async scheduling, a structured step deferred) The runner's drafts of the step's
        placeholder drafts, checked by each structured request's grammar, into its output."""
        self.grammars.check_drafts(self.requests, draft_token_ids, scheduler_output)

    def _finish(self, request: Request, seq_id: int, kind: str, stop_token: int | None) -> Any:
        """vLLM learns the finish now; kvsched folds the same token at the next step and
        retires the request itself ("stop", "length": checked), or by an abort (a
        ``stop_token_ids`` hit, a rule kvsched does not have)."""
        request.status = _STATUS[kind]
        request.stop_reason = stop_token
        del self.requests[request.request_id]
        if kind in ("stop_token", "error"):
            self._inputs.append(ev.RequestAborted(seq_id, f"stop token {stop_token}"))
        else:
            self._expected[seq_id] = request.request_id
        return request.get_finished_reason()

    def reset_encoder_cache(self) -> None:
        self.encoders.reset()

    def reset_prefix_cache(
        self, reset_running_requests: bool = False, reset_connector: bool = False
    ) -> bool:
        """Clear the prefix cache at the next step (kvsched's drain, then wake). Without
        ``reset_running_requests`` it fails, as vLLM's does, while an unfinished request holds
        blocks (a request vLLM has finished is retired by the same step, before the drain)."""
        if not reset_running_requests and any(
            r.status == RequestStatus.RUNNING for r in self.requests.values()
        ):
            return False
        self._inputs += [ev.DrainRequested(), ev.WakeRequested()]
        if reset_connector and self.connector is not None:
            self.connector.reset_cache()
        return True

    # ------------------------------------------------------------------ pause, KV events, end

    def set_pause_state(self, pause_state: PauseState) -> None:
        """PAUSED_NEW holds kvsched's admissions from the next step on, PAUSED_ALL what runs
        too (``AdmissionsHeld``, in the log); UNPAUSED lifts the hold."""
        if pause_state != self._pause:
            held = pause_state != PauseState.UNPAUSED
            running = pause_state == PauseState.PAUSED_ALL
            self._inputs.append(ev.AdmissionsHeld(held=held, running=running))
        self._pause = pause_state

    def shutdown(self) -> None:
        self.kv_event_publisher.shutdown()
        if self.connector is not None:
            self.connector.shutdown()
        if self.engine.log is not None:
            self.engine.log.close()


def _has_prompt_logprobs(mro: Any) -> bool:
    return bool(mro.prompt_logprobs_dict or getattr(mro, "prompt_token_id_logprobs_dict", None))


def _logprobs(mro: Any, request: Request, name: str, n: int) -> tuple[Any, tuple[Any, Any]]:
    """The sample logprobs of the request's ``n`` tokens, if it asked for them, and its
    prompt logprobs (rare), as vLLM's runner gave them."""
    logprobs = None
    if mro.logprobs is not None and request.sampling_params.logprobs is not None:
        logprobs = mro.logprobs.slice_request(mro.req_id_to_index[name], n)
    tensors = mro.prompt_logprobs_dict
    ids = getattr(mro, "prompt_token_id_logprobs_dict", None)
    if not tensors and not ids:
        return logprobs, NO_PROMPT
    return logprobs, ((tensors or {}).get(name), (ids or {}).get(name))
