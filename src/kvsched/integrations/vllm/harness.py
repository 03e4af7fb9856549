"""A scheduler-level differential harness: one script of ``SchedulerInterface`` calls drives
vLLM's own scheduler or kvsched's adapter, with synthetic model outputs, no model and no
worker (needs vLLM).

    trace = drive(make("kvsched", vllm_config, kv), script, order="async", vocab=...)

A script is a list of ``Add`` / ``Steps`` / ``Abort`` / ``ResetCache``. The "model" is a pure
function of (request, position): the token sampled after ``p`` tokens of request ``r`` is
``token(r, p)`` whatever the schedule, as greedy decoding of a fixed model gives. Like vLLM's
model runner, the driver counts each request's tokens (its prompt, then each token it samples;
after a preemption, the tokens the scheduler sends again), and a row samples only when it
computes all of them, so a chunk that ends earlier, or a recompute, samples nothing. It also
holds the scheduler to the runner's rule: a request the last step did not schedule comes back
with all its tokens (``CachedRequestData.all_token_ids``, which the asynchronous runner reads).

Two call orders, as vLLM's engine core makes them:
* ``sync`` (``EngineCore.step``): ``schedule()`` then ``update_from_output()`` of that step;
* ``async`` (``EngineCore.step_with_batch_queue``, a queue of two): step N+1 is scheduled
  before step N's output is given back, whenever the scheduler has requests; a step flagged
  ``pending_structured_output_tokens`` gets its grammar bitmask only after that output.

Structured outputs (``Add(structured=True)``): both schedulers are given the same kind of
manager (``harness_grammar.CountingGrammars``), whose bitmask calls are compared.

Speculative decoding (``drafts`` > 0): the runner proposes that many drafts after each token
it samples, each the model's token with probability ``acceptance`` (a hash of request and
position), and a row that verifies drafts samples the model's tokens after each position while
the drafts agree, as a target model would. In the synchronous order the engine core hands the
proposals to the scheduler (``update_draft_token_ids``, its ``post_step``); in the
asynchronous order it does not (vLLM's ``AsyncScheduler`` schedules placeholder drafts, -1),
and the runner verifies its own proposals, after the tokens it really has (a row planned with
drafts still out is written after the accepted ones, as vLLM's GPU runner corrects it). The
runner also holds the scheduler to vLLM's count of a request's outputs: a cached request's
``num_output_tokens`` never below the tokens the runner sampled for it (the runner cuts its
own list to that count; under async scheduling it includes the tokens still out).

Multimodal items (``Add(items=...)``): every chunk must find its items' encoder outputs in the
runner (``RunnerEncoder``). KV connectors: ``harness_connector``. The trace holds, per step
that ran work, its token counts and drafts per request; per request its tokens, finish.
"""

from __future__ import annotations

import zlib
from collections import deque
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs

from kvsched.integrations.vllm import runner_states as rs
from kvsched.integrations.vllm.harness_grammar import NoGrammar
from kvsched.integrations.vllm.models import STATE_DTYPE

__all__ = [
    "Abort", "Add", "Driver", "NoGrammar", "ResetCache", "Steps", "Trace", "configs", "drive",
    "hybrid_configs", "make", "token", "vllm_request",
]  # fmt: skip


@attrs.frozen
class Add:
    """A request: its prompt, ``max_tokens``, and a stop token after ``stop_after`` outputs
    (the token the model samples there, so the request ends early), if given."""

    name: str
    prompt: tuple[int, ...]
    max_tokens: int
    stop_after: int | None = None
    structured: bool = False  # a structured output (the harness's CountingGrammars)
    items: tuple[tuple[int, int, str], ...] = ()  # audio items: (offset, length, content hash)


@attrs.frozen
class Steps:
    """``count`` engine steps (each one loop of the engine core)."""

    count: int


@attrs.frozen
class Abort:
    name: str


@attrs.frozen
class ResetCache:
    """``reset_prefix_cache(reset_running_requests=True)``: running requests are preempted."""


Op = Add | Steps | Abort | ResetCache


def token(name: str, position: int, vocab: int) -> int:
    """The synthetic model: the token sampled after ``position`` tokens of ``name``."""
    return 3 + zlib.crc32(f"{name}:{position}".encode()) % (vocab - 3)


@attrs.define
class Trace:
    steps: list[dict[str, int]] = attrs.Factory(list)  # per step that ran work
    drafts: list[dict[str, list[int]]] = attrs.Factory(list)  # drafts verified, per step
    outputs: dict[str, list[int]] = attrs.Factory(dict)  # tokens each request received
    finished: dict[str, str] = attrs.Factory(dict)  # how each request ended
    preempted: set[str] = attrs.Factory(set)  # requests preempted at least once
    empty: int = 0  # steps scheduled while requests were unfinished that ran nothing
    states_checked: int = 0  # (hybrid) forwards that continued a state, each checked
    cached: dict[str, int] = attrs.Factory(dict)  # each request's cached prompt tokens
    accepted: int = 0  # drafts the runner accepted
    rejected: int = 0  # and rejected
    encoded: int = 0  # encoder inputs the runner computed
    external: list[int] = attrs.Factory(lambda: [0, 0])  # connector queries, hits (stats)


def configs(
    model_dir: str,
    blocks: int,
    max_seqs: int,
    batched: int,
    block_size: int = 64,
    drafts: int = 0,
    method: str = "ngram",
    connector: bool = False,
) -> tuple[Any, Any]:
    """A ``VllmConfig`` for a local model (weights never loaded; a multimodal model's tokenizer
    loaded, for its processor) and a ``KVCacheConfig`` of one full-attention group of
    ``blocks`` blocks (block 0 vLLM's null block); ``drafts``: speculative decoding with that
    many draft tokens (``method``: ``ngram``, whose drafts the engine core hands over in the
    synchronous order, ``ngram_gpu``, which vLLM runs under async scheduling, or ``eagle3``,
    a drafter with lookahead slots and EAGLE's prefix-cache rule, in both orders);
    ``connector``: the harness's KV connector (``harness_connector``)."""
    import torch
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    from kvsched.integrations.vllm import harness_connector

    args = EngineArgs(
        model=model_dir,
        skip_tokenizer_init=not Path(model_dir, "preprocessor_config.json").exists(),
        enforce_eager=True,
        block_size=block_size,
        max_model_len=4096,
        max_num_seqs=max_seqs,
        max_num_batched_tokens=batched,
        enable_prefix_caching=True,
        dtype="float32",
        speculative_config=(
            {"method": method, "num_speculative_tokens": drafts}
            | ({"model": model_dir} if method.startswith("eagle") else {})  # (its own weights:
            if drafts  # the model's config stands in for the draft head's, never loaded)
            else None
        ),
        async_scheduling=False if (drafts and method == "ngram") or connector else None,
        kv_transfer_config=harness_connector.TRANSFER if connector else None,
    )
    vllm_config = args.create_engine_config()
    vllm_config.cache_config.num_gpu_blocks = blocks  # what the engine sets after profiling
    spec = FullAttentionSpec(
        block_size=block_size, num_kv_heads=1, head_size=64, dtype=torch.float32
    )
    kv = KVCacheConfig(
        num_blocks=blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(layer_names=["l0", "l1"], kv_cache_spec=spec)],
    )
    return vllm_config, kv


def hybrid_configs(model_dir: str, blocks: int, max_seqs: int) -> tuple[Any, Any]:
    """vLLM's own ``VllmConfig`` and ``KVCacheConfig`` for a hybrid model in ``align`` mode
    with ``blocks`` KV cache blocks: vLLM sizes a hybrid model's groups and state pages only
    once the model is built, so this builds an offline engine (in this process, under vLLM's
    own scheduler) and keeps its configs. One per process."""
    from vllm import LLM

    llm = LLM(
        model_dir,
        enforce_eager=True,
        max_model_len=4096,
        max_num_batched_tokens=4096,
        max_num_seqs=max_seqs,
        enable_prefix_caching=True,  # (a hybrid model's states then cache in "align" mode)
        seed=0,
        skip_tokenizer_init=True,
        num_gpu_blocks_override=blocks,
        mamba_ssm_cache_dtype=STATE_DTYPE,  # (the same block size on every CPU)
    )
    _ENGINES.append(llm)  # (alive: its engine's shutdown would clear the configs' sizes)
    sched = llm.llm_engine.engine_core.engine_core.scheduler
    return sched.vllm_config, sched.kv_cache_config


_ENGINES: list[Any] = []


def make(kind: str, vllm_config: Any, kv: Any, grammars: Any = None, stats: bool = False) -> Any:
    """vLLM's ``Scheduler`` ("vllm"), its ``AsyncScheduler`` ("vllm-async") or kvsched's
    adapter ("kvsched") over these configs (``grammars``: its structured-output manager;
    default, one that none is requested of; ``stats``: ``log_stats``)."""
    cls: Any
    if kind == "kvsched":
        from kvsched.integrations.vllm.scheduler import Scheduler

        cls = Scheduler
    elif kind == "vllm-async":
        from vllm.v1.core.sched.async_scheduler import AsyncScheduler

        cls = AsyncScheduler
    elif kind == "vllm":
        from vllm.v1.core.sched.scheduler import Scheduler as VllmScheduler

        cls = VllmScheduler
    else:
        raise ValueError(f"unknown scheduler {kind!r}: vllm, vllm-async or kvsched")
    from vllm.v1.core.kv_cache_utils import resolve_kv_cache_block_sizes
    block, hash_block = resolve_kv_cache_block_sizes(kv, vllm_config)
    return cls(
        vllm_config=vllm_config,
        kv_cache_config=kv,
        structured_output_manager=grammars if grammars is not None else NoGrammar(),
        block_size=block,
        hash_block_size=hash_block,
        log_stats=stats,
    )


def vllm_request(op: Add, vocab: int, hasher: Any) -> Any:
    from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
    from vllm.sampling_params import SamplingParams, StructuredOutputsParams
    from vllm.v1.request import Request

    stop = []
    if op.stop_after is not None:
        stop = [token(op.name, len(op.prompt) + op.stop_after, vocab)]
    grammar = StructuredOutputsParams(regex="t.*") if op.structured else None
    params = SamplingParams(
        temperature=0.0, ignore_eos=True, max_tokens=op.max_tokens, stop_token_ids=stop,
        structured_outputs=grammar,
    )
    features = [
        MultiModalFeatureSpec(None, "audio", h, PlaceholderRange(offset=o, length=n))
        for o, n, h in op.items
    ]
    return Request(
        op.name, list(op.prompt), params, None, mm_features=features or None, block_hasher=hasher
    )


class Driver:
    """Plays the engine core and a model runner around one scheduler."""

    def __init__(
        self,
        sched: Any,
        vocab: int,
        drafts: int = 0,
        acceptance: float = 0.6,
        states: rs.RunnerStates | None = None,
        grammars: Any = None,
    ) -> None:
        self.sched = sched
        self.grammars = grammars  # (structured requests: the manager both schedulers share)
        self.structured: set[str] = set()
        self.proposed: dict[str, list[int]] = {}  # (async) the runner's drafts, last step
        self.blocks = rs.RunnerBlocks(sched.vllm_config)  # (its block tables' lengths)
        self.encoder = rs.RunnerEncoder()  # (the encoder outputs it holds)
        self.states = states  # (a hybrid model: where the runner keeps its states)
        self.prompt_ids: dict[str, list[int]] = {}  # each request's prompt
        self.vocab = vocab
        self.drafts, self.acceptance = drafts, acceptance
        self.sampled: list[str] = []  # the requests the last step sampled
        self.trace = Trace()
        self.known: dict[str, int] = {}
        self.batch: set[str] = set()  # the requests the runner's batch holds (last step's)
        self.queue: deque[tuple[Any, Any]] = deque()

    def run_model(self, so: Any) -> Any:
        """The model runner's output for a scheduled step (the synthetic model)."""
        from vllm.v1.outputs import ModelRunnerOutput

        from kvsched.integrations.vllm.harness_connector import worker_report

        known = self.known  # the runner's token count per request: as it would hold it
        computed = {}
        for r in so.scheduled_new_reqs:
            computed[r.req_id] = r.num_computed_tokens
            self.prompt_ids[r.req_id] = list(r.prompt_token_ids)
            known[r.req_id] = len(r.prompt_token_ids)
        if self.states is not None:
            self.states.schedule(so)
        cached = so.scheduled_cached_reqs
        kept = self.batch - set(cached.resumed_req_ids)  # (the runner keeps their token lists)
        for name, outs in zip(cached.req_ids, cached.num_output_tokens, strict=True):
            prompt = len(self.prompt_ids[name])
            if name in kept and prompt + outs < known[name]:
                raise AssertionError(  # (the runner cuts its token list to this count)
                    f"request {name}: num_output_tokens {outs} < the "
                    f"{known[name] - prompt} the runner sampled"
                )
        computed.update(zip(cached.req_ids, cached.num_computed_tokens, strict=True))
        if self.states is None:  # (an attention model: its one group)
            self.blocks.step(so, computed)
        self.encoder.step(so, computed)
        resent = cached.all_token_ids or {}
        for name, tokens in resent.items():
            known[name] = len(tokens)  # (resent: a resumed request's sampled tokens are these)
        missing = [n for n in cached.req_ids if n not in self.batch and n not in resent]
        if missing:  # (vLLM's asynchronous runner reads them: KeyError on a GPU)
            raise AssertionError(
                f"requests {missing} absent from the last step come back "
                "without their tokens (CachedRequestData.all_token_ids)"
            )
        for name, ids in zip(cached.req_ids, cached.new_block_ids, strict=True):
            if name in cached.resumed_req_ids and ids is None:  # (the runner asserts it)
                raise AssertionError(f"request {name} resumed without its block table")
        names = list(so.num_scheduled_tokens)
        self.batch = set(names)  # the runner's persistent batch: what this step schedules
        sampled = []
        spec = so.scheduled_spec_decode_tokens or {}
        for name in names:
            end = computed[name] + so.num_scheduled_tokens[name]
            if self.states is not None:
                self.states.forward(name, computed[name], end, self._tokens(name, end))
            guesses = spec.get(name, [])
            if end >= known[name]:
                first = known[name]  # the index of the first token it samples
                if -1 in guesses:  # (placeholders: the runner's own proposals)
                    guesses = [self._draft(name, first + j) for j in range(len(guesses))]
                    self.proposed[name] = guesses
                    if name in self.structured:  # (rejected where its grammar cuts them)
                        guesses = self.grammars.validate_tokens(None, guesses)
                made = [token(name, first, self.vocab)]
                for j, guess in enumerate(guesses):  # (a draft is the guess at first + j)
                    if guess != made[-1]:
                        break
                    made.append(token(name, first + j + 1, self.vocab))
                sampled.append(made)
                known[name] = first + len(made)
                self.trace.accepted += len(made) - 1
                self.trace.rejected += len(guesses) + 1 - len(made)
            else:
                sampled.append([])
        self.sampled = [n for n, got in zip(names, sampled, strict=True) if got]
        if names:
            self.trace.steps.append(dict(so.num_scheduled_tokens))
            self.trace.drafts.append({n: list(d) for n, d in spec.items()})
        else:
            self.trace.empty += 1
        self.trace.preempted |= set(so.preempted_req_ids or ())
        return ModelRunnerOutput(
            req_ids=names,
            req_id_to_index={n: i for i, n in enumerate(names)},
            sampled_token_ids=sampled,
            kv_connector_output=worker_report(so),
        )

    def _tokens(self, name: str, n: int) -> list[int]:
        """The first ``n`` tokens of ``name`` as the runner holds them (its prompt, then the
        model's tokens: what it sampled)."""
        prompt = self.prompt_ids[name]
        return prompt[:n] + [token(name, p, self.vocab) for p in range(len(prompt), n)]

    def update(self, so: Any, mro: Any) -> None:
        results = self.sched.update_from_output(so, mro)
        for outs in results.values():
            connector = outs.scheduler_stats and outs.scheduler_stats.connector_prefix_cache_stats
            if connector:  # (with stats: the connector's prefix-cache counts)
                self.trace.external[0] += connector.queries
                self.trace.external[1] += connector.hits
            for out in outs.outputs:
                self.trace.outputs.setdefault(out.request_id, []).extend(out.new_token_ids)
                if out.prefill_stats is not None:  # (with its first token)
                    self.trace.cached[out.request_id] = out.prefill_stats.num_cached_tokens
                if out.finish_reason is not None:
                    self.trace.finished[out.request_id] = str(out.finish_reason)

    def step_sync(self) -> None:
        so = self.sched.schedule()
        self.sched.get_grammar_bitmask(so)  # (the engine core asks for it before sampling)
        self.update(so, self.run_model(so))
        if self.drafts and so.total_num_scheduled_tokens:
            self.propose()

    def propose(self) -> None:
        """The engine core's ``post_step``: drafts for the requests the step sampled."""
        from vllm.v1.outputs import DraftTokenIds

        names, lists = self.sampled, []
        for name in names:
            at = self.known[name]  # the index of the token after its newest
            lists.append([self._draft(name, at + j) for j in range(self.drafts)])
        self.sched.update_draft_token_ids(DraftTokenIds(names, lists))

    def _draft(self, name: str, index: int) -> int:
        """The model's token at ``index`` when a hash falls under ``acceptance``, else
        another token."""
        right = token(name, index, self.vocab)
        coin = zlib.crc32(f"draft:{name}:{index}".encode()) % 1000
        return right if coin < 1000 * self.acceptance else 3 + (right - 2) % (self.vocab - 3)
    def step_async(self) -> None:
        """One call of ``step_with_batch_queue`` with a queue of two: a step whose structured
        rows have tokens still out (``pending_structured_output_tokens``) gets its bitmask
        only after the output before it is given back (and, with drafts, its drafts checked
        by the grammar: ``update_draft_token_ids_in_output``)."""
        from vllm.v1.outputs import DraftTokenIds

        deferred = None
        if self.sched.has_requests():
            so = self.sched.schedule()
            out = (so, self.run_model(so))
            ran = so.total_num_scheduled_tokens > 0
            if ran and so.pending_structured_output_tokens:
                deferred = out
            else:
                if ran:
                    self.sched.get_grammar_bitmask(so)
                self.queue.appendleft(out)
                if len(self.queue) < 2 and (ran or self.sched.has_requests()):
                    return
        elif not self.queue:
            return
        self.update(*self.queue.pop())
        if deferred is not None:
            so = deferred[0]
            if self.drafts:
                names = [n for n in so.scheduled_spec_decode_tokens if n in self.proposed]
                ids = [list(self.proposed[n]) for n in names]
                self.sched.update_draft_token_ids_in_output(DraftTokenIds(names, ids), so)
            self.sched.get_grammar_bitmask(so)
            self.queue.appendleft(deferred)

    def drain(self) -> None:
        """The async order's outputs still queued are given back (the engine's next calls)."""
        while self.queue:
            self.update(*self.queue.pop())


def drive(
    sched: Any,
    script: Sequence[Op],
    order: str,
    vocab: int,
    block_size: int,
    drafts: int = 0,
    kv: Any = None,
    grammars: Any = None,
) -> Trace:
    """Run ``script`` against ``sched`` in the ``sync`` or ``async`` call order
    (``block_size``: vLLM's block-hash size, that of the requests' ``block_hashes``;
    ``drafts``: draft tokens proposed after each sampled token; ``kv``: the
    ``KVCacheConfig``, whose mamba group, if any, the runner's states are followed in:
    ``RunnerStates``; ``grammars``: the structured-output manager ``sched`` was made with,
    for ``Add(structured=True)`` requests: ``CountingGrammars``)."""
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import RequestStatus

    if order not in ("sync", "async"):
        raise ValueError(f"order must be 'sync' or 'async', not {order!r}")
    init_none_hash(sha256)
    hasher = get_request_block_hasher(block_size, sha256)
    group = None if kv is None else rs.mamba_group(kv)
    states = None if group is None else rs.RunnerStates(*group)
    driver = Driver(sched, vocab, drafts, states=states, grammars=grammars)
    step = driver.step_sync if order == "sync" else driver.step_async
    for op in script:
        if isinstance(op, Add):
            request = vllm_request(op, vocab, hasher)
            if op.structured:  # (the engine core compiles its grammar before adding it)
                grammars.grammar_init(request)
                driver.structured.add(op.name)
            sched.add_request(request)
        elif isinstance(op, Abort):
            sched.finish_requests(op.name, RequestStatus.FINISHED_ABORTED)
            driver.trace.finished.setdefault(op.name, "abort")
        elif isinstance(op, ResetCache):
            if not sched.reset_prefix_cache(reset_running_requests=True):
                raise RuntimeError("reset_prefix_cache refused with running requests reset")
        else:
            for _ in range(op.count):
                step()
    if order == "async":
        driver.drain()
    if driver.states is not None:
        driver.trace.states_checked = driver.states.checked
    driver.trace.encoded = driver.encoder.computed
    return driver.trace
