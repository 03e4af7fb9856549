"""``KvschedConnector``'s options and placement checks, without vLLM (``store_connector.py``
is the connector; these are read by its constructor and tested in every environment)."""

from __future__ import annotations

from typing import Any

import attrs

from kvsched.connectors.drills import Drill, DrillStore
from kvsched.connectors.protocol import KVStore

NAME = "KvschedConnector"
SCHEDULER = "kvsched.integrations.vllm.Scheduler"


class StoreOptionsError(ValueError):
    """``kv_connector_extra_config`` asks for something KvschedConnector does not do."""


@attrs.frozen(kw_only=True)
class StoreOptions:
    store: str
    synchronous: bool = False
    lookup_timeout_s: float = 5.0
    job_timeout_s: float = 10.0
    wait_prefilled_s: float = 30.0
    drill: dict[str, Any] | None = None  # a fault drill on the worker's store (drills.py)

    @classmethod
    def parse(cls, extra: dict[str, Any]) -> StoreOptions:
        known = {f.name for f in attrs.fields(cls)}
        unknown = set(extra) - known
        if unknown:
            raise StoreOptionsError(
                f"{NAME}: unknown kv_connector_extra_config keys {sorted(unknown)} "
                f"(known: {sorted(known)})"
            )
        store = extra.get("store")
        if not isinstance(store, str) or not store.startswith(("dir:", "mooncake:")):
            raise StoreOptionsError(
                f"{NAME}: kv_connector_extra_config 'store' must be 'dir:PATH' or "
                f"'mooncake:HOST:PORT' (the Mooncake master), got {store!r}"
            )
        for key in ("lookup_timeout_s", "job_timeout_s", "wait_prefilled_s"):
            value = extra.get(key, 1.0)
            if not isinstance(value, int | float) or value < 0:
                raise StoreOptionsError(f"{NAME}: {key} must be seconds >= 0, got {value!r}")
        if not isinstance(extra.get("synchronous", False), bool):
            raise StoreOptionsError(f"{NAME}: synchronous must be true or false")
        if extra.get("drill") is not None:
            try:
                Drill.parse(extra["drill"])
            except (TypeError, ValueError) as exc:
                raise StoreOptionsError(f"{NAME}: drill: {exc}") from exc
        return cls(**extra)

    @property
    def local(self) -> bool:
        """Whether the store is a directory on this machine (probed inline)."""
        return self.store.startswith("dir:")

    def open(self) -> KVStore:
        """A client of the store (each process opens its own)."""
        kind, _, where = self.store.partition(":")
        if kind == "dir":
            from kvsched.connectors.directory_store import DirectoryStore

            return DirectoryStore(where)
        from kvsched.connectors.mooncake_store import MooncakeStore

        return MooncakeStore(where, timeout_s=self.lookup_timeout_s)

    def open_worker(self) -> KVStore:
        """The worker's client: with a ``drill``, failing on its cue."""
        store = self.open()
        return store if self.drill is None else DrillStore(store, Drill.parse(self.drill))


def refuse_placement(vllm_config: Any, scheduler_side: bool) -> None:
    """Refuse, with the way out, a vLLM configuration the connector cannot serve: its
    scheduler side under another scheduler than kvsched's (whose policy decides every
    transfer), or more than one worker."""
    if scheduler_side:
        cls = vllm_config.scheduler_config.scheduler_cls
        name = cls if isinstance(cls, str) or cls is None else f"{cls.__module__}.{cls.__name__}"
        if not str(name).startswith("kvsched."):
            raise StoreOptionsError(
                f"{NAME} runs under kvsched's scheduler only (its policy decides the "
                f"transfers): start vLLM with --scheduler-cls {SCHEDULER}"
            )
    if vllm_config.parallel_config.world_size != 1:
        raise StoreOptionsError(f"{NAME} runs on one worker (tensor parallel size 1)")
