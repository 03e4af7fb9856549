"""The sub-configs of ``SchedulerConfig`` for what an engine does around its steps: an
external KV store, speculation and overlapped steps, and preemption. ``kvsched.config``
re-exports them with the rest of the configuration."""

from __future__ import annotations

from typing import Literal

import attrs

from kvsched.headers import in_range, is_bool, one_of, refuse

Role = Literal["both", "prefill", "decode"]


@attrs.frozen(kw_only=True)
class ExternalStore:
    """An external KV store: look up prefixes beyond the local cache and load them; save
    computed blocks (and aligned state checkpoints) to it (roles both and prefill)."""

    enabled: bool = False
    # Disaggregation: a prefill-role engine ends each request after its first token (reason
    # "migrated") once its prompt is saved; a decode-role engine loads prompts, saves nothing.
    role: Role = "both"
    # Who saves: "kvsched" (its policy: KVSaveStarted, leases) or "connector" (a serving
    # engine's KV connector saves on its own, as vLLM's do; kvsched looks up and loads).
    saver: str = "kvsched"

    def __attrs_post_init__(self) -> None:
        is_bool("external.enabled", self.enabled)
        one_of("external.role", self.role, ("both", "prefill", "decode"))
        one_of("external.saver", self.saver, ("kvsched", "connector"))
        if self.saver != "kvsched" and not self.enabled:
            raise refuse(f"external.saver {self.saver!r}", "external.enabled", "needs")
        if self.role != "both" and not self.enabled:
            raise refuse(f"external.role {self.role!r}", "external.enabled", "needs")


@attrs.frozen(kw_only=True)
class Speculation:
    """MTP: a hit's last cached block(s) are recomputed for the draft model (Legacy.mtp_overlap)."""

    tokens: int = 0  # speculative tokens per step (0: no MTP)
    # Speculative decoding: at most this many of the drafts an executor proposes for a
    # sequence (StepExecuted.drafts) are verified in its next decode, in positions that take
    # KV blocks (0: drafts ignored; attention models: no state per draft position).
    max_drafts: int = 0
    # Overlapped steps (vLLM's async scheduling): step N+1 is planned while N's outcome is
    # out (an input of N+1 or N+2); a row sampling in a step in flight counts a placeholder.
    pipelined: bool = False
    # A drafter writing KV of its own (vLLM's EAGLE family): a row's blocks hold ``lookahead``
    # positions past its work (``num_lookahead_tokens``, capped at the context); with
    # ``eagle_block_drop`` a hit gives up its last block, recomputed for the drafter.
    lookahead: int = 0
    eagle_block_drop: bool = False

    def __attrs_post_init__(self) -> None:
        in_range("speculation.tokens", self.tokens, 0, 64)
        in_range("speculation.max_drafts", self.max_drafts, 0, 64)
        in_range("speculation.lookahead", self.lookahead, 0, 64)
        if self.eagle_block_drop and self.tokens:
            raise refuse(
                "speculation.eagle_block_drop", "speculation.tokens (MTP)", "is not supported with"
            )


@attrs.frozen(kw_only=True)
class Preemption:
    """What a step that preempts does: kvsched's rules by default, vLLM's under the adapter."""

    # Whether waiting sequences are admitted in a step that preempted (kvsched: yes, all but
    # the sequence preempted; vLLM admits nothing in such a step, keeping the room it made for
    # the running ones). Flat name: admit_after_preemption.
    admit_after: bool = True
    # Order "fcfs": the victim is the running sequence that took its batch row last (vLLM's
    # running.pop(): a request whose load kept it waiting enters after later arrivals), not
    # the latest arrival (kvsched's). Flat name: preempt_latest_entered.
    latest_entered: bool = False

    def __attrs_post_init__(self) -> None:
        is_bool("admit_after_preemption", self.admit_after)
        is_bool("preempt_latest_entered", self.latest_entered)


__all__ = ["ExternalStore", "Preemption", "Role", "Speculation"]
