"""The differential harness's KV connector (needs vLLM): a store of prompt prefixes that
fills as requests finish and loads asynchronously, so one script drives vLLM's connector
protocol under vLLM's own scheduler and under kvsched's adapter alike.

Scheduler side: ``get_num_new_matched_tokens`` answers the longest stored prefix (whole
blocks, short of the last token) beyond the local hit, loaded asynchronously; a request whose
name starts with ``slow`` gets "not known yet" (``None``) the first time it is asked.
``request_finished`` stores the request's computed prompt blocks; for a request named
``hold...`` it keeps them (a delayed free) while it "sends" them for ``SEND_STEPS`` steps.
``build_connector_meta`` lists the loads the step starts; the harness's runner reports each
one finished in that step's output (``finished_recving``), or, for a request named
``bad...``, the second block of its load bad (``invalid_block_ids``), for one named
``lost...`` the whole load failed (``failed_recving``), and each send when its
steps are up (``finished_sending``), checking meanwhile that no step hands a block being
sent to a request.

    vllm_config.kv_transfer_config = KVTransferConfig(**harness_connector.TRANSFER)
"""

from __future__ import annotations

from typing import Any, ClassVar

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
)

SEND_STEPS = 3  # worker steps a delayed free's transfer takes
TRANSFER = {
    "kv_connector": "HarnessConnector",
    "kv_connector_module_path": "kvsched.integrations.vllm.harness_connector",
    "kv_role": "kv_both",
    "kv_load_failure_policy": "recompute",
}


class HarnessMeta(KVConnectorMetadata):  # type: ignore[misc]
    def __init__(self, loads: dict[str, list[int]]) -> None:
        self.loads = loads  # request name -> the block ids its load writes


class HarnessConnector(KVConnectorBase_V1):  # type: ignore[misc]
    # The store (prefixes of token ids, in whole blocks), shared by the schedulers of one
    # run; ``reset`` empties it before each.
    store: ClassVar[set[tuple[int, ...]]] = set()
    sending: ClassVar[dict[str, tuple[list[int], int]]] = {}  # name -> (blocks, steps left)

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        self.block = int(vllm_config.cache_config.block_size)
        self._asked: set[str] = set()
        self._loads: dict[str, list[int]] = {}

    @classmethod
    def reset(cls) -> None:
        cls.store.clear()
        cls.sending.clear()

    # ------------------------------------------------------------------ scheduler side

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> Any:
        name = request.request_id
        if name.startswith("slow") and name not in self._asked:
            self._asked.add(name)
            return None, False
        prompt = list(request.prompt_token_ids)
        hit = 0
        while hit + self.block < len(prompt) and tuple(prompt[: hit + self.block]) in self.store:
            hit += self.block
        tokens = max(0, hit - num_computed_tokens)
        return tokens, tokens > 0

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        if num_external_tokens:
            ids = blocks.get_block_ids()[0]
            first = len(ids) - num_external_tokens // self.block  # (the blocks past the hit)
            self._loads[request.request_id] = ids[first:]

    def build_connector_meta(self, scheduler_output: Any) -> HarnessMeta:
        meta, self._loads = HarnessMeta(self._loads), {}
        return meta

    def request_finished(self, request: Any, block_ids: list[int]) -> Any:
        prompt = list(request.prompt_token_ids)
        computed = min(request.num_computed_tokens, len(prompt))
        for end in range(self.block, computed - computed % self.block + 1, self.block):
            self.store.add(tuple(prompt[:end]))
        if request.request_id.startswith("hold") and block_ids:
            self.sending[request.request_id] = (list(block_ids), SEND_STEPS)
            return True, None
        return False, None

    # ------------------------------------------------------------------ worker side (none)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        return None

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kw: Any) -> None:
        return None

    def wait_for_save(self) -> None:
        return None


def worker_report(so: Any) -> Any:
    """The runner's ``KVConnectorOutput`` for a scheduled step: every load finished, the
    second block of a ``bad...`` request's load reported bad, the sends whose steps are up
    (None: nothing to report). A block the step gives a request while it is being sent is a
    harness failure (the scheduler freed it early)."""
    from vllm.v1.outputs import KVConnectorOutput

    sending = HarnessConnector.sending
    held = {b for blocks, _ in sending.values() for b in blocks}
    given = [ids[0] for ids in (r.block_ids for r in so.scheduled_new_reqs)]
    given += [ids[0] for ids in so.scheduled_cached_reqs.new_block_ids if ids is not None]
    reused = held & {b for ids in given for b in ids}
    if reused:
        raise AssertionError(f"blocks {sorted(reused)} given to a request while being sent")
    sent = {name for name, (_, left) in sending.items() if left <= 1}
    for name, (blocks, left) in list(sending.items()):
        sending[name] = (blocks, left - 1)
    for name in sent:
        del sending[name]
    loads = getattr(so.kv_connector_metadata, "loads", None) or {}
    if not loads and not sent:
        return None
    bad = {ids[1] for name, ids in loads.items() if name.startswith("bad") and len(ids) > 1}
    lost = {name for name in loads if name.startswith("lost")}
    return KVConnectorOutput(
        finished_recving=set(loads),
        invalid_block_ids=bad,
        failed_recving=lost,
        finished_sending=sent,
    )
