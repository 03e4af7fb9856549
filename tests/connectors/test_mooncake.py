"""The connector against a real Mooncake Store (master + memory holder over loopback TCP),
inside a private network namespace. Select with ``pytest -k mooncake``."""

from __future__ import annotations

from typing import Any


def test_mooncake_round_trip_of_blocks_and_state_is_byte_identical(mooncake: Any) -> None:
    mooncake.run("round_trip")


def test_mooncake_lookup_counts_only_leading_present_blocks_per_namespace(mooncake: Any) -> None:
    mooncake.run("lookup_leading")


def test_mooncake_load_with_a_missing_block_fails_keeping_the_leading_good_blocks(
    mooncake: Any,
) -> None:
    mooncake.run("missing_and_failing_blocks")


def test_mooncake_memory_holder_killed_fails_the_load_as_transfer_fail_in_bounded_time(
    mooncake: Any,
) -> None:
    info = mooncake.run("holder_killed_during_load")
    assert info["load_fail_s"] < 5.0


def test_mooncake_master_killed_fails_the_load_and_lookup_as_rpc_fail_in_bounded_time(
    mooncake: Any,
) -> None:
    info = mooncake.run("master_killed_during_load")
    assert info["load_fail_s"] < 5.0


def test_mooncake_frozen_master_times_out_instead_of_hanging(mooncake: Any) -> None:
    info = mooncake.run("master_frozen_during_load")
    assert info["load_fail_s"] < 3.0


def test_mooncake_second_process_looks_up_and_loads_blocks_byte_identical(mooncake: Any) -> None:
    mooncake.run("two_processes_share_blocks")
