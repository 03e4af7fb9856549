"""Reading a log header's config: the flat names of earlier headers, what an old schema ran
where its header is silent, and the legacy record's mark."""

from __future__ import annotations

import pytest

from kvsched.config import SchedulerConfig
from kvsched.headers import FLAT_NAMES, ConfigError, Legacy, header_settings


def test_every_flat_name_reads_into_its_sub_config() -> None:
    config = SchedulerConfig.from_log_header(
        {
            "checkpoint_budget": 7,
            "turn_mode": "alternate",
            "num_speculative_tokens": 2,
            "admit_after_preemption": False,  # (a top-level field of headers before 2026-12-07)
        },
        4,
    )
    assert config.checkpoints.budget == 7 and config.turns.mode == "alternate"
    assert config.speculation.tokens == 2
    assert not config.preemption.admit_after and not config.preemption.latest_entered
    assert all(
        sub in ("checkpoints", "turns", "external", "speculation", "preemption", "legacy")
        for sub, _ in FLAT_NAMES.values()
    )


def test_a_silent_schema_3_header_gets_what_kvsched_ran_then_in_either_shape() -> None:
    flat = header_settings({}, 3)
    assert flat["identity"] == "blake2b" and flat["mtp_overlap"] == "k_blocks"
    nested = header_settings({"checkpoints": {}, "turns": {}, "legacy": {}}, 3)
    assert nested["legacy"]["mtp_overlap"] == "k_blocks" and nested["legacy"]["header"]
    assert nested["checkpoints"]["min_gain_blocks"] == 0


def test_a_header_of_todays_shape_keeps_its_own_legacy_mark() -> None:
    written = SchedulerConfig().to_dict()
    assert header_settings(written, 4)["legacy"]["header"] is False
    assert header_settings({}, 4)["legacy"]["header"] is True  # (a flat header: an old log's)


def test_a_legacy_record_refuses_an_unknown_value_even_from_a_header() -> None:
    with pytest.raises(ConfigError, match=r"legacy\.session_reclaim"):
        Legacy(header=True, session_reclaim="oldest")
