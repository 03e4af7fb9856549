"""The configuration: one screen of fields, refusals of ignored or contradictory settings
naming both, the legacy record only from a log header, one table of defaults."""

from __future__ import annotations

import re
from typing import Any

import attrs
import pytest

from kvsched import config as cfg
from kvsched.cli import build_parser
from kvsched.config import (
    CHECKPOINT_POLICIES,
    Checkpoints,
    ConfigError,
    Legacy,
    Preemption,
    PrefillTurns,
    SchedulerConfig,
)
from kvsched.replay.demo import run_demo
from kvsched.replay.setup import checkpoint_fields


def test_the_scheduler_config_has_at_most_20_fields_of_its_own() -> None:
    assert len(attrs.fields(SchedulerConfig)) <= 20


def _refused(match: str, **fields: Any) -> None:
    with pytest.raises(ConfigError, match=re.escape(match)):
        SchedulerConfig.from_dict(fields)


@pytest.mark.parametrize(
    ("fields", "setting", "other"),
    [
        (
            {"checkpoint_placement": ("chunk_end", "decode")},
            "checkpoints.placement 'decode'",
            "checkpoints.decode_interval",
        ),
        (
            {"decode_checkpoint_interval": 64},
            "checkpoints.placement 'decode'",
            "checkpoints.decode_interval",
        ),
        (
            {"mid_chunk_saves": False},
            "checkpoints.placement 'interval'",
            "checkpoints.mid_chunk_saves",
        ),
        (
            {"checkpoint_placement": ("chunk_end",), "checkpoint_interval": 1024},
            "checkpoints.interval",
            "checkpoints.placement 'interval'",
        ),
        (
            {"checkpoint_eviction": "frozen_first", "aligned_checkpoints_only": True},
            "checkpoints.eviction 'frozen_first'",
            "checkpoints.aligned_only",
        ),
        ({"checkpoint_eviction": "lru", "value_pair_s": 1e-9}, "value_pair_s", "'value'"),
        ({"checkpoint_memory": 1 << 30, "checkpoint_budget": 8}, "budget", "memory"),
        ({"prefill_interval": 4}, "turns.prefill_interval", "turns.mode 'alternate'"),
        ({"prefill_turns": "short_only"}, "turns.policy", "order 'ttft'"),
        ({"long_order": "fifo", "order": "priority"}, "turns.long_order", "order 'ttft'"),
        ({"short_turns_per_long": 2}, "turns.short_per_long", "order 'ttft'"),
        (
            {"order": "ttft", "prefill_turns": "standard", "short_turns_per_long": 2},
            "turns.short_per_long",
            "turns.policy 'interleave'",
        ),
        ({"role": "prefill"}, "external.role", "external.enabled"),
        (
            {"checkpoint_placement": ("oracle",), "checkpoint_eviction": "value"},
            "checkpoints.placement 'oracle'",
            "checkpoints.eviction 'oracle'",
        ),
        (
            {"checkpoint_placement": ("chunk_end",), "checkpoint_eviction": "oracle"},
            "checkpoints.eviction 'oracle'",
            "checkpoints.placement 'oracle' alone",
        ),
        (
            {
                "checkpoint_placement": ("oracle",),
                "checkpoint_eviction": "oracle",
                "mid_chunk_saves": False,
            },
            "checkpoints.placement 'oracle'",
            "checkpoints.mid_chunk_saves",
        ),
    ],
    ids=lambda v: v if isinstance(v, str) else None,
)
def test_a_setting_another_makes_ignored_is_refused_naming_both(
    fields: dict[str, Any], setting: str, other: str
) -> None:
    with pytest.raises(ConfigError) as refused:
        SchedulerConfig.from_dict({"hybrid": True, **fields})
    assert setting in str(refused.value) and other in str(refused.value)


@pytest.mark.parametrize(
    "fields",
    [
        {"checkpoint_budget": 8},
        {"checkpoint_eviction": "lru"},
        {"checkpoint_placement": ("chunk_end",)},
    ],
    ids=lambda f: next(iter(f)),
)
def test_a_checkpoint_setting_on_an_attention_model_is_refused_naming_hybrid(
    fields: dict[str, Any],
) -> None:
    with pytest.raises(ConfigError, match=r"checkpoints\.\w+ is used only with hybrid"):
        SchedulerConfig.from_dict({"hybrid": False, **fields})
    assert SchedulerConfig.from_dict({"hybrid": True, **fields}).hybrid


def test_every_named_checkpoint_policy_builds_a_config_nothing_in_it_ignored() -> None:
    for name in CHECKPOINT_POLICIES:
        config = SchedulerConfig(hybrid=True).with_checkpoint_policy(name)
        assert config.checkpoints.placement == CHECKPOINT_POLICIES[name]["placement"]


def test_the_lmdeploy_policy_places_no_decode_checkpoints_and_decode_needs_an_interval() -> None:
    lmdeploy = Checkpoints(**CHECKPOINT_POLICIES["lmdeploy"])
    assert "decode" not in lmdeploy.placement
    with_decode = attrs.evolve(lmdeploy, placement=(*lmdeploy.placement, "decode"))
    with pytest.raises(ConfigError, match="decode_interval"):
        SchedulerConfig(hybrid=True, block_size=16, checkpoints=with_decode)
    ok = attrs.evolve(with_decode, decode_interval=64)
    assert SchedulerConfig(hybrid=True, block_size=16, checkpoints=ok).places("decode")


def test_a_new_config_cannot_set_a_behaviour_of_kvsched_before_schema_4() -> None:
    with pytest.raises(ConfigError, match=r"legacy\.keep_aborted_turns.*from_log_header"):
        SchedulerConfig(legacy=Legacy(keep_aborted_turns=False))
    with pytest.raises(ConfigError, match=r"legacy\.mtp_overlap"):
        SchedulerConfig.from_dict({"mtp_overlap": "k_blocks"})
    assert SchedulerConfig().legacy == Legacy() and not SchedulerConfig().legacy.header


def test_a_header_before_schema_4_fills_the_legacy_record() -> None:
    old = SchedulerConfig.from_log_header({}, schema_version=3)
    assert old.legacy.header and not old.legacy.keep_aborted_turns
    assert old.legacy.mtp_overlap == "k_blocks" and old.legacy.load_admission == "whole_prompt"
    assert old.identity == "blake2b" and old.checkpoints.min_gain_blocks == 0
    assert SchedulerConfig.from_log_header({}, schema_version=4).legacy == Legacy(header=True)


def test_an_old_header_holding_a_now_refused_combination_still_reads() -> None:
    header = {
        "hybrid": True,
        "order": "fcfs",
        "prefill_turns": "long_first",
        "checkpoint_placement": ["chunk_end", "decode"],
        "decode_checkpoint_interval": 0,
    }
    old = SchedulerConfig.from_log_header(header, schema_version=4)
    assert old.turns.policy == "long_first" and old.places("decode")
    with pytest.raises(ConfigError):
        SchedulerConfig.from_dict(header)


def test_a_new_log_header_reads_back_as_the_config_that_wrote_it() -> None:
    config = SchedulerConfig(
        order="ttft", turns=PrefillTurns(policy="long_first"), hybrid=True
    ).with_checkpoint_policy("sglang")
    assert SchedulerConfig.from_log_header(config.to_dict(), schema_version=4) == config


def test_the_library_the_cli_and_the_vllm_adapter_share_one_table_of_defaults() -> None:
    config = SchedulerConfig()
    assert (config.block_size, config.num_blocks, config.max_batch) == (
        cfg.BLOCK_SIZE,
        cfg.NUM_BLOCKS,
        cfg.MAX_BATCH_ROWS,
    )
    assert config.max_prefill_tokens == cfg.MAX_PREFILL_TOKENS
    assert config.checkpoints.budget == cfg.CHECKPOINT_BUDGET
    demo = build_parser().parse_args(["demo"])
    assert (demo.cache_blocks, demo.max_batch) == (cfg.DEMO_NUM_BLOCKS, cfg.DEMO_MAX_BATCH)
    defaults = run_demo.__kwdefaults__ or {}
    assert (defaults["cache_blocks"], defaults["max_batch"]) == (
        cfg.DEMO_NUM_BLOCKS,
        cfg.DEMO_MAX_BATCH,
    )
    replay = build_parser().parse_args(["replay", "trace.jsonl"])
    assert replay.max_batch is None and replay.cache_blocks is None  # (the config's; unbounded)


def test_the_vllm_kvsched_policy_caches_blocks_at_planning_as_the_adapter_does() -> None:
    config = SchedulerConfig(hybrid=True).with_checkpoint_policy("vllm-kvsched")
    assert config.cache_when_planned and not config.dedup_cached_blocks
    assert config.checkpoints.eviction == "value" and config.checkpoints.aligned_only
    fields = checkpoint_fields(policy="vllm-kvsched")
    assert fields["cache_when_planned"] is True and fields["dedup_cached_blocks"] is False
    assert fields["admit_after_preemption"] is False and not config.preemption.admit_after
    assert fields["preempt_latest_entered"] is True and config.preemption.latest_entered


def test_vllms_no_admission_after_a_preemption_is_refused_with_the_ttft_orders_turns() -> None:
    with pytest.raises(ConfigError, match=r"admit_after_preemption false.*order 'ttft'"):
        SchedulerConfig(order="ttft", preemption=Preemption(admit_after=False))
    flat = SchedulerConfig.from_dict({"admit_after_preemption": False})
    assert not flat.preemption.admit_after
    with pytest.raises(ConfigError, match="admit_after_preemption"):
        Preemption(admit_after="no")  # type: ignore[arg-type]


def test_blocks_cached_when_planned_serve_a_connectors_loads_and_kvscheds_own_saves():
    """Under vLLM a KV connector saves on its own (``external.saver = "connector"``), or
    kvsched does (``KvschedConnector``: its saves start when the outcome that wrote their
    blocks is folded, ``ExternalKVMachineUnderVllmStore``); both with blocks cached at
    planning. A saver without a store is refused."""
    planned = {"cache_when_planned": True, "dedup_cached_blocks": False}
    connector = {"enabled": True, "saver": "connector"}
    config = SchedulerConfig.from_dict({**planned, "external": connector})
    assert config.external_load and not config.external_save
    own = SchedulerConfig.from_dict({**planned, "external": {"enabled": True}})
    assert own.external_load and own.external_save
    with pytest.raises(ConfigError, match=r"external\.saver 'connector'"):
        SchedulerConfig.from_dict({"external": {"saver": "connector"}})
