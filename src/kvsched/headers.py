"""What a log header holds besides today's settings: the ``Legacy`` record of kvsched's
behaviours before schema 4 (only an old log's header sets them), the flat names of settings in
headers written before the sub-configs, and the errors and checks config records share."""

from __future__ import annotations

from typing import Any

import attrs

MTP_OVERLAPS: tuple[str, ...] = ("one_block", "k_blocks")  # Legacy.mtp_overlap
LOAD_ADMISSIONS: tuple[str, ...] = ("soft", "whole_prompt")  # Legacy.load_admission


class ConfigError(ValueError):
    """A setting out of range, unknown, ignored because of another, or contradicting one."""


def in_range(name: str, value: int, lo: int, hi: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise ConfigError(f"{name} must be an integer in [{lo}, {hi}], got {value!r}")


def one_of(name: str, value: object, known: tuple[str, ...]) -> None:
    if value not in known:
        raise ConfigError(f"unknown {name} {value!r}; known: {', '.join(known)}")


def is_bool(name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise ConfigError(f"{name} must be a bool, got {value!r}")


def refuse(setting: str, other: str, why: str) -> ConfigError:
    return ConfigError(f"{setting} {why} {other}: change one of them")


def refuse_oracle_mix(placement: tuple[str, ...], eviction: str, mid_chunk_saves: bool) -> None:
    """The oracle's rules go together (``config.CHECKPOINT_POLICIES["oracle"]``): its placement
    needs its eviction (the future is recorded only where it saves: an online eviction would
    measure neither), its eviction knows next uses only where its placement saves, and it
    saves inside chunks (mid-chunk saves)."""
    if "oracle" in placement and eviction != "oracle":
        raise refuse("checkpoints.placement 'oracle'", "checkpoints.eviction 'oracle'", "needs")
    if eviction == "oracle" and placement != ("oracle",):
        alone = "checkpoints.placement 'oracle' alone"
        raise refuse("checkpoints.eviction 'oracle'", alone, "needs")
    if "oracle" in placement and not mid_chunk_saves:
        raise refuse("checkpoints.placement 'oracle'", "checkpoints.mid_chunk_saves", "needs")


@attrs.frozen(kw_only=True)
class Legacy:
    """kvsched's behaviours before schema 4, kept only to replay old logs: like Temporal's
    ``patched()`` markers, only an old log's header sets them (``from_log_header`` marks the
    record ``header``); a new run has today's behaviour, these defaults. A config from a
    header is also exempt from the refusals of ignored combinations (an old log may hold one).
    """

    header: bool = False  # filled from a log header
    # An aborted turn of an open session stays part of its history (its full blocks held for
    # the next turn), as lmdeploy keeps a stopped turn; False: the history stays as it was.
    keep_aborted_turns: bool = True
    # Idle sessions' held blocks are reclaimed least recently used first, or by session id.
    session_reclaim: str = "last_use"
    # Alternate turns: a prefill turn is also due when a running sequence's next chunk is its
    # last, or when the waiting tokens fill max_prefill_tokens (False: neither).
    prefill_on_last_chunk: bool = True
    prefill_on_waiting_tokens: bool = True
    # Finished and aborted sequences report the prompt tokens their first admission did not
    # compute (False: the events carry no counts).
    report_cached_tokens: bool = True
    # What an MTP hit recomputes: "one_block", the last cached block into a private block
    # while the sequence holds the cached one (lmdeploy); "k_blocks", the last
    # Speculation.tokens cached blocks, swapped for the cached copies once computed.
    mtp_overlap: str = "one_block"
    # Multimodal spans are never split by a chunk, hit, load or state save (False: hits only).
    multimodal_safe: bool = True
    # TTFT order: a waiting request sized by the tokens left after its tentative prefix match
    # ("after_match"), or by its whole context, session history included ("context").
    ttft_size: str = "after_match"
    # An external load: "soft" (lmdeploy's) takes no batch row and holds only the blocks it
    # loads into, the rest of its prompt reserved softly; "whole_prompt" takes a batch row and
    # every block of its prompt at once.
    load_admission: str = "soft"

    def __attrs_post_init__(self) -> None:
        for flag in (
            "header",
            "keep_aborted_turns",
            "prefill_on_last_chunk",
            "prefill_on_waiting_tokens",
            "report_cached_tokens",
            "multimodal_safe",
        ):
            is_bool(f"legacy.{flag}", getattr(self, flag))
        one_of("legacy.session_reclaim", self.session_reclaim, ("last_use", "session_id"))
        one_of("legacy.mtp_overlap", self.mtp_overlap, MTP_OVERLAPS)
        one_of("legacy.ttft_size", self.ttft_size, ("after_match", "context"))
        one_of("legacy.load_admission", self.load_admission, LOAD_ADMISSIONS)
        if not self.header:
            for field in attrs.fields(Legacy)[1:]:
                if getattr(self, field.name) != field.default:
                    raise ConfigError(
                        f"legacy.{field.name} {getattr(self, field.name)!r}: only an old log's "
                        "header sets a behaviour of kvsched before schema 4 "
                        "(SchedulerConfig.from_log_header)"
                    )


# The flat names of sub-config fields in headers written before the sub-configs (schema 4
# and older, and every kvsched before this shape): flat name -> (sub-config, field).
FLAT_NAMES: dict[str, tuple[str, str]] = {
    "checkpoint_budget": ("checkpoints", "budget"),
    "checkpoint_memory": ("checkpoints", "memory"),
    "checkpoint_placement": ("checkpoints", "placement"),
    "checkpoint_eviction": ("checkpoints", "eviction"),
    "checkpoint_interval": ("checkpoints", "interval"),
    "decode_checkpoint_interval": ("checkpoints", "decode_interval"),
    "checkpoint_min_gain_blocks": ("checkpoints", "min_gain_blocks"),
    "mid_chunk_saves": ("checkpoints", "mid_chunk_saves"),
    "aligned_checkpoints_only": ("checkpoints", "aligned_only"),
    "value_token_s": ("checkpoints", "value_token_s"),
    "value_pair_s": ("checkpoints", "value_pair_s"),
    "turn_mode": ("turns", "mode"),
    "prefill_interval": ("turns", "prefill_interval"),
    "max_long_chunks_per_step": ("turns", "max_long_chunks_per_step"),
    "prefill_turns": ("turns", "policy"),
    "short_turns_per_long": ("turns", "short_per_long"),
    "long_order": ("turns", "long_order"),
    "external_kv": ("external", "enabled"),
    "role": ("external", "role"),
    "num_speculative_tokens": ("speculation", "tokens"),
    "admit_after_preemption": ("preemption", "admit_after"),
    "preempt_latest_entered": ("preemption", "latest_entered"),
    **{f.name: ("legacy", f.name) for f in attrs.fields(Legacy)[1:]},
}
FLAT_OF: dict[tuple[str, str], str] = {where: flat for flat, where in FLAT_NAMES.items()}


# What a header before schema 4 ran (flat names): every Legacy behaviour, and the TTFT
# order's long-first turns.
BEFORE_SCHEMA_4: dict[str, Any] = {
    "keep_aborted_turns": False,
    "session_reclaim": "session_id",
    "prefill_on_last_chunk": False,
    "prefill_on_waiting_tokens": False,
    "decode_prealloc_tokens": 0,
    "report_cached_tokens": False,
    "mtp_overlap": "k_blocks",
    "multimodal_safe": False,
    "ttft_size": "context",
    "prefill_turns": "long_first",
    "long_order": "size",
    "load_admission": "whole_prompt",
}
# Before schema 3 (no checkpoint policies): lmdeploy's rules as they were then, "decode"
# included (a header's decode_checkpoint_interval set its spacing), no mid-chunk saves.
LMDEPLOY_BEFORE_SCHEMA_3: dict[str, Any] = {
    "checkpoint_placement": ("chunk_end", "prompt_end", "decode"),
    "checkpoint_eviction": "frozen_first",
    "aligned_checkpoints_only": False,
    "checkpoint_min_gain_blocks": 0,
    "mid_chunk_saves": False,
}


def header_settings(data: dict[str, Any], schema_version: int) -> dict[str, Any]:
    """A header's config as ``SchedulerConfig.from_dict`` reads it (flat or nested): a header
    older than schema 4 gets what its kvsched ran where it is silent (blake2b identity, no
    minimum checkpoint gain, every Legacy behaviour; before schema 3, lmdeploy's checkpoint
    rules and no mid-chunk saves). The legacy record of an old log (flat, or older than
    schema 4) is marked ``header``: exempt from today's refusals of ignored combinations."""
    data = {k: dict(v) if isinstance(v, dict) else v for k, v in data.items()}
    pinned: dict[str, Any] = {}
    if schema_version < 4:
        pinned.update(identity="blake2b", checkpoint_min_gain_blocks=0, **BEFORE_SCHEMA_4)
    if schema_version < 3:
        pinned.update(LMDEPLOY_BEFORE_SCHEMA_3)
    for flat, value in pinned.items():
        sub, name = FLAT_NAMES.get(flat, ("", flat))
        if sub and isinstance(data.get(sub), dict):
            data[sub].setdefault(name, value)
        elif flat not in data:
            data[flat] = value
    is_flat = not any(isinstance(data.get(sub), dict) for sub in ("checkpoints", "turns"))
    if is_flat or schema_version < 4:  # (a nested header of today's shape keeps its own mark)
        data["legacy"] = {**dict(data.get("legacy") or {}), "header": True}
    return data
