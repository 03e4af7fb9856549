"""The vLLM adapter's translation rules, without vLLM (these run in every environment)."""

from __future__ import annotations

from types import SimpleNamespace as NS

import numpy as np
import pytest

from kvsched.integrations.vllm import config as cfg
from kvsched.integrations.vllm.requests import arrival, refusal, stop_reason, stop_rule
from kvsched.integrations.vllm.store_options import StoreOptions, StoreOptionsError


def _vllm_config(**sched: object) -> NS:
    scheduler = {"max_num_seqs": 8, "max_num_batched_tokens": 256, "policy": "fcfs", **sched}
    scheduler.setdefault("async_scheduling", False)
    return NS(
        scheduler_config=NS(**scheduler),
        model_config=NS(model="tiny", get_vocab_size=lambda: 512, max_model_len=2048),
        cache_config=NS(cache_dtype="auto", enable_prefix_caching=True, mamba_cache_mode="align"),
        parallel_config=NS(pipeline_parallel_size=1),
        speculative_config=None,
        num_lookahead_tokens=0,
        num_prefill_lookahead_tokens=0,
        lora_config=None,
        kv_transfer_config=None,
        additional_config={},
    )


def _spec(eagle: bool = False, slots: int = 0, k: int = 3) -> NS:
    """A speculative_config as the adapter reads it (ngram unless ``eagle``)."""
    return NS(
        method="eagle" if eagle else "ngram",
        num_speculative_tokens=k,
        use_eagle=lambda: eagle,
        use_eagle_block_drop=lambda: eagle,
        max_num_new_slots_for_drafting=slots,
        num_speculative_tokens_per_batch_size=None,
    )


FullAttentionSpec = type("FullAttentionSpec", (), {})
MambaSpec = type("MambaSpec", (), {})
SlidingWindowSpec = type("SlidingWindowSpec", (), {})


def _kv_cache(*specs: type, num_blocks: int = 100) -> NS:
    return NS(num_blocks=num_blocks, kv_cache_groups=[NS(kv_cache_spec=s()) for s in specs])


def test_vllm_kv_cache_and_budgets_become_kvscheds_config():
    config = cfg.scheduler_config(_vllm_config(), _kv_cache(FullAttentionSpec), 32)

    assert (config.block_size, config.num_blocks, config.max_batch) == (32, 100, 8)
    assert config.max_prefill_tokens == 256 - 8  # one token of the budget per decode
    assert config.model.vocab_size == 512 and config.model.max_context == 2048
    assert not config.dedup_cached_blocks  # vLLM's block tables are append-only


def test_vllm_async_scheduling_overlaps_kvscheds_steps_for_attention_and_hybrid_models():
    attention = _kv_cache(FullAttentionSpec)
    on = cfg.scheduler_config(_vllm_config(async_scheduling=True), attention, 32)
    off = cfg.scheduler_config(_vllm_config(), attention, 32)
    hybrid = cfg.scheduler_config(
        _vllm_config(async_scheduling=True), _kv_cache(FullAttentionSpec, MambaSpec), 32
    )

    with_drafts = _vllm_config(async_scheduling=True)
    with_drafts.speculative_config = _spec()  # (ngram_gpu: vLLM's async drafter)
    drafting = cfg.scheduler_config(with_drafts, attention, 32)

    assert on.speculation.pipelined and not off.speculation.pipelined
    assert hybrid.hybrid and hybrid.speculation.pipelined
    assert drafting.speculation.pipelined and drafting.speculation.max_drafts == 3


def test_vllm_eagle_drafter_becomes_lookahead_slots_and_eagles_prefix_rule():
    vc = _vllm_config()
    vc.speculative_config, vc.num_lookahead_tokens = _spec(eagle=True), 3
    config = cfg.scheduler_config(vc, _kv_cache(FullAttentionSpec), 32)

    assert config.speculation.lookahead == 3 and config.speculation.eagle_block_drop
    assert config.mtp_recompute_blocks == 1 and not config.mtp_holds_overlap


def test_vllm_priority_policy_maps_to_kvscheds_priority_order():
    config = cfg.scheduler_config(_vllm_config(policy="priority"), _kv_cache(FullAttentionSpec), 32)
    assert config.order == "priority"


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"kv": (FullAttentionSpec, FullAttentionSpec)}, "one full-attention KV cache group"),
        ({"kv": (SlidingWindowSpec,)}, "SlidingWindowSpec"),
        ({"mamba_cache_mode": "none"}, "mamba_cache_mode 'align'"),
        ({"speculative_config": _spec(slots=1)}, "method 'ngram'.*extra query slots"),
        ({"speculative_config": _spec(), "lookahead": 3}, "method 'ngram'.*draft model's KV"),
        ({"speculative_config": _spec(), "kv": (FullAttentionSpec, MambaSpec)}, "hybrid model"),
        ({"speculative_config": _spec(k=30)}, "leaves 8 prefill tokens .* of 31 tokens"),
        ({"max_num_batched_tokens": 36}, "leaves 28 prefill tokens"),
    ],
)
def test_vllm_configurations_the_adapter_cannot_serve_are_refused_with_the_reason(
    change: dict, message: str
):
    vc = _vllm_config(
        **(
            {"max_num_batched_tokens": change["max_num_batched_tokens"]}
            if "max_num_batched_tokens" in change
            else {}
        ),
        async_scheduling=change.get("async", False),
    )
    for key in ("speculative_config", "lora_config"):
        if key in change:
            setattr(vc, key, change[key])
    vc.num_lookahead_tokens = change.get("lookahead", 0)
    kv = _kv_cache(*change.get("kv", (FullAttentionSpec,)))
    if "mamba_cache_mode" in change:
        vc.cache_config.mamba_cache_mode = change["mamba_cache_mode"]
        kv = _kv_cache(FullAttentionSpec, MambaSpec)

    with pytest.raises(cfg.UnsupportedConfig, match=message):
        cfg.scheduler_config(vc, kv, 32)


def _with_connector(vc: NS, policy: str = "fail") -> NS:
    vc.kv_transfer_config = NS(kv_connector="ExampleConnector", kv_load_failure_policy=policy)
    return vc


def test_vllm_a_kv_connector_makes_kvsched_look_up_and_load_while_the_connector_saves():
    vc = _with_connector(_vllm_config())
    config = cfg.scheduler_config(vc, _kv_cache(FullAttentionSpec), 32)
    assert config.external.enabled and config.external.saver == "connector"
    assert config.external_load and not config.external_save and config.cache_when_planned
    assert cfg.fails_loads(vc) and not cfg.fails_loads(_with_connector(_vllm_config(), "recompute"))
    plain = cfg.scheduler_config(_vllm_config(), _kv_cache(FullAttentionSpec), 32)
    assert not plain.external.enabled


@pytest.mark.parametrize("role, saves", [("kv_both", True), ("kv_consumer", False)])
def test_vllm_kvsched_connector_lets_kvsched_save_with_hybrid_states_unless_a_consumer(
    role: str, saves: bool
):
    """``KvschedConnector``: kvsched decides its saves (a hybrid model's too), none as a
    ``kv_consumer`` (a decode engine: kvsched's role "decode")."""
    vc = _vllm_config()
    vc.kv_transfer_config = NS(
        kv_connector="KvschedConnector", kv_load_failure_policy="recompute", kv_role=role
    )
    vc.cache_config.mamba_cache_mode = "align"
    config = cfg.scheduler_config(vc, _kv_cache(FullAttentionSpec, MambaSpec), 32)
    assert config.hybrid and config.external.saver == "kvsched"
    assert config.external_load and config.external_save == saves
    assert config.external.role == ("both" if saves else "decode")


@pytest.mark.parametrize(
    "extra, message",
    [
        ({}, "'store' must be 'dir:PATH' or 'mooncake:HOST:PORT'"),
        ({"store": "s3://x"}, "'store' must be"),
        ({"store": "dir:/x", "speed": 3}, r"unknown kv_connector_extra_config keys \['speed'\]"),
        ({"store": "dir:/x", "job_timeout_s": -1}, "job_timeout_s must be seconds >= 0"),
        ({"store": "dir:/x", "synchronous": "yes"}, "synchronous must be true or false"),
        ({"store": "dir:/x", "drill": {"mode": "melt"}}, "drill: drill mode must be one of"),
    ],
)
def test_vllm_kvsched_connector_refuses_malformed_options_with_the_reason(extra, message):
    with pytest.raises(StoreOptionsError, match=message):
        StoreOptions.parse(extra)


@pytest.mark.parametrize(
    "change, message",
    [
        ({"kv": (FullAttentionSpec, MambaSpec)}, "ExampleConnector .* hybrid model"),
        ({"lookahead": 3, "eagle": True}, "ExampleConnector .* drafter that writes KV"),
    ],
)
def test_vllm_a_kv_connector_is_refused_where_kvsched_cannot_serve_it_with_the_reason(
    change: dict, message: str
):
    vc = _with_connector(_vllm_config(async_scheduling=change.get("async", False)))
    vc.kv_transfer_config.kv_connector = change.get("name", "ExampleConnector")
    if change.get("eagle"):
        vc.speculative_config, vc.num_lookahead_tokens = _spec(eagle=True), change["lookahead"]
    with pytest.raises(cfg.UnsupportedConfig, match=message):
        cfg.scheduler_config(vc, _kv_cache(*change.get("kv", (FullAttentionSpec,))), 32)


@pytest.mark.parametrize(
    "name, kinds",
    [
        ("ExampleConnector", (FullAttentionSpec,)),
        ("KvschedConnector", (FullAttentionSpec, MambaSpec)),
    ],
)
def test_vllm_a_kv_connector_under_async_scheduling_runs_on_overlapped_steps(name, kinds):
    vc = _with_connector(_vllm_config(async_scheduling=True), "recompute")
    vc.kv_transfer_config.kv_connector, vc.kv_transfer_config.kv_role = name, "kv_both"
    vc.cache_config.mamba_cache_mode = "align"
    config = cfg.scheduler_config(vc, _kv_cache(*kinds), 32)
    assert config.speculation.pipelined and config.external_load
    assert config.external_save == (name == "KvschedConnector")


def test_vllm_ngram_speculative_decoding_sets_the_drafts_and_the_prefill_budget():
    vc = _vllm_config()
    vc.speculative_config = _spec(k=3)
    config = cfg.scheduler_config(vc, _kv_cache(FullAttentionSpec), 32)
    assert config.speculation.max_drafts == 3
    assert config.max_prefill_tokens == 256 - 8 * 4  # each decode may take 1 + 3 tokens


def test_vllm_adapter_options_come_from_additional_config_before_the_environment(monkeypatch):
    monkeypatch.setenv(cfg.LOG_ENV, "/tmp/env.kvlog")
    monkeypatch.delenv(cfg.OVERWRITE_ENV, raising=False)
    monkeypatch.delenv(cfg.UNTESTED_ENV, raising=False)
    vc = _vllm_config()
    flags = {"overwrite_log": False, "allow_untested_vllm": False}
    assert cfg.options(vc) == {"log": "/tmp/env.kvlog", **flags}
    vc.additional_config = {"kvsched": {"log": "/tmp/mine.kvlog"}}
    assert cfg.options(vc) == {"log": "/tmp/mine.kvlog", **flags}
    vc.additional_config = {"kvsched": {"lgo": "x"}}
    with pytest.raises(cfg.UnsupportedConfig, match="unknown kvsched options"):
        cfg.options(vc)


def test_vllm_each_data_parallel_rank_past_the_first_writes_its_own_log(monkeypatch):
    monkeypatch.setenv(cfg.LOG_ENV, "/tmp/run.kvlog")
    vc = _vllm_config()
    vc.parallel_config = NS(data_parallel_size=1, data_parallel_index=0)
    assert cfg.options(vc)["log"] == "/tmp/run.kvlog"
    vc.parallel_config = NS(data_parallel_size=1, data_parallel_index=1)  # (a dense model's)
    assert cfg.options(vc)["log"] == "/tmp/run.dp1.kvlog"
    monkeypatch.setenv(cfg.LOG_ENV, "/tmp/v1.0/run")
    assert cfg.options(vc)["log"] == "/tmp/v1.0/run.dp1"


def test_vllm_an_existing_log_path_is_refused_unless_overwrite_is_asked_for(tmp_path, monkeypatch):
    monkeypatch.delenv(cfg.OVERWRITE_ENV, raising=False)
    log = tmp_path / "run.kvlog"
    log.write_bytes(b"previous run")
    vc = _vllm_config()
    vc.additional_config = {"kvsched": {"log": str(log)}}
    opts = cfg.options(vc)
    with pytest.raises(cfg.UnsupportedConfig, match="already exists"):
        cfg.check_log_path(opts["log"], opts["overwrite_log"])
    cfg.check_log_path(str(tmp_path / "new.kvlog"), False)  # a new path is fine
    vc.additional_config = {"kvsched": {"log": str(log), "overwrite_log": True}}
    assert cfg.options(vc)["overwrite_log"] is True
    monkeypatch.setenv(cfg.OVERWRITE_ENV, "1")
    vc.additional_config = {"kvsched": {"log": str(log)}}
    assert cfg.options(vc)["overwrite_log"] is True
    vc.additional_config = {"kvsched": {"overwrite_log": "yes"}}
    with pytest.raises(cfg.UnsupportedConfig, match="overwrite_log must be"):
        cfg.options(vc)


def test_vllm_log_overwrite_environment_variable_replaces_a_log_only_when_it_is_1(monkeypatch):
    vc = _vllm_config()
    for value, overwrite in (("1", True), ("0", False), ("", False), ("yes", False)):
        monkeypatch.setenv(cfg.OVERWRITE_ENV, value)
        assert cfg.options(vc)["overwrite_log"] is overwrite, value


def test_vllm_request_check_is_found_under_a_dotted_qualname_after_the_colon():
    vc = _vllm_config()
    vc.model_config.logits_processors = ["kvsched.integrations.vllm:checks.RequestCheck"]
    assert cfg.has_request_check(vc)  # vLLM walks the dotted name after ":" to the class


def test_vllm_request_check_is_found_among_the_logits_processors_by_name_or_class():
    vc = _vllm_config()
    vc.model_config.logits_processors = None
    assert not cfg.has_request_check(vc)
    vc.model_config.logits_processors = ["kvsched.integrations.vllm:RequestCheck"]
    assert cfg.has_request_check(vc)
    vc.model_config.logits_processors = [type("RequestCheck", (), {})]
    assert cfg.has_request_check(vc)


def test_vllm_run_hybrid_defaults_give_a_budget_of_the_whole_context():
    from kvsched.integrations.vllm.run import budgets

    def ns(**kw: object) -> NS:
        return NS(**{"hybrid": False, "batched_tokens": None, "max_model_len": None, **kw})

    assert budgets(ns()) == (256, 2048)
    assert budgets(ns(hybrid=True)) == (4096, 4096)  # holds a 640-token state page and more
    assert budgets(ns(hybrid=True, max_model_len=1024)) == (1024, 1024)
    assert budgets(ns(hybrid=True, batched_tokens=2048)) == (2048, 4096)


def test_vllm_run_attention_budget_stays_256_tokens_whatever_the_context_length():
    from kvsched.integrations.vllm.run import budgets

    args = NS(hybrid=False, batched_tokens=None, max_model_len=1024)
    assert budgets(args) == (256, 1024)  # only a hybrid model's budget follows the context


def _params(**over: object) -> NS:
    base = {
        "eos_token_id": None,
        "stop_token_ids": [],
        "temperature": 0.0,
        "seed": None,
        "prompt_logprobs": None,
        "min_tokens": 0,
        "n": 1,
    }
    return NS(**{**base, **over})


def _request(**over: object) -> NS:
    base = {
        "request_id": "r",
        "prompt_token_ids": [5, 6, 7],
        "sampling_params": _params(),
        "mm_features": [],
        "lora_request": None,
        "structured_output_request": None,
        "max_tokens": 4,
        "arrival_time": 100.5,
        "priority": 3,
        "cache_salt": None,
        "num_tokens": 3,
        "num_output_tokens": 0,
    }
    return NS(**{**base, **over})


def test_a_vllm_request_becomes_an_arrival_with_its_priority_sign_flipped():
    e = arrival(_request(), seq_id=7, t0=100.0)

    assert e.seq_id == 7 and e.prompt.tolist() == [5, 6, 7] and e.prompt.dtype == np.int32
    assert (e.max_tokens, e.arrival_time, e.priority, e.eos_token_id) == (4, 0.5, -3, -1)


def test_a_vllm_request_keeps_vllms_block_digests_when_the_adapter_is_told_to():
    sha = [bytes([i]) * 32 for i in range(1, 4)]  # sha256 digests are 32 bytes: truncated
    e = arrival(_request(block_hashes=sha), seq_id=1, t0=0.0, use_block_hashes=True)
    assert e.block_hashes == b"".join(h[:16] for h in sha)
    short = arrival(_request(block_hashes=[b"\x07" * 8]), seq_id=2, t0=0.0, use_block_hashes=True)
    assert short.block_hashes == b"\x07" * 8 + b"\0" * 8  # shorter digests are zero-padded
    assert arrival(_request(block_hashes=sha), seq_id=3, t0=0.0).block_hashes == b""
    vc = _vllm_config()
    vc.additional_config = {"kvsched": {"block_hashes": "sha256"}}
    with pytest.raises(cfg.UnsupportedConfig, match="block_hashes must be"):
        cfg.options(vc)


@pytest.mark.parametrize(
    ("over", "reason"),
    [
        ({"sampling_params": None}, "pooling"),
        (
            {"sampling_params": _params(repetition_detection=NS(max_pattern_size=2))},
            "repetition detection",
        ),
    ],
)
def test_vllm_requests_with_unsupported_features_are_refused_with_the_reason(over, reason):
    assert reason in (refusal(_request(**over)) or "")
    assert refusal(_request()) is None


def _item(offset: int, length: int, identifier: str) -> NS:
    return NS(mm_position=NS(offset=offset, length=length), identifier=identifier)


def test_vllm_multimodal_items_arrive_as_spans_named_by_their_content_hash():
    request = _request(mm_features=[_item(10, 25, "aa11"), _item(50, 5, "bb22")])
    assert refusal(request) is None
    spans = arrival(request, seq_id=1, t0=0.0).mm_spans
    assert [(s.start, s.end, s.content_hash) for s in spans] == [
        (10, 35, b"aa11"),
        (50, 55, b"bb22"),
    ]


def test_vllm_a_multimodal_model_gets_vllms_encoder_budget_and_span_slices():
    config = cfg.scheduler_config(_vllm_config(), _kv_cache(FullAttentionSpec), 32, 750)
    assert config.model.max_encoder_tokens == 750 and config.model.span_slices


def test_vllm_a_lora_request_arrives_with_its_lora_name_as_its_adapter_and_max_loras_binds():
    lora = NS(lora_name="sql-v2", lora_int_id=3)
    assert refusal(_request(lora_request=lora)) is None
    assert arrival(_request(lora_request=lora), seq_id=1, t0=0.0).adapter == "sql-v2"
    assert arrival(_request(), seq_id=2, t0=0.0).adapter == ""
    vc = _vllm_config()
    vc.lora_config = NS(max_loras=2)
    assert cfg.scheduler_config(vc, _kv_cache(FullAttentionSpec), 32).model.max_adapters == 2
    plain = cfg.scheduler_config(_vllm_config(), _kv_cache(FullAttentionSpec), 32)
    assert plain.model.max_adapters == 0


def test_vllm_a_request_with_a_structured_output_is_served():
    over = {"structured_output_request": object()}
    assert refusal(_request(**over, sampling_params=_params(structured_outputs=object()))) is None


def test_vllm_a_request_that_skips_reading_the_prefix_cache_arrives_asking_for_no_hit():
    # vLLM sets skip_reading_prefix_cache for prompt logprobs (0 included): every prompt
    # position must be computed
    request = _request(sampling_params=_params(prompt_logprobs=0), skip_reading_prefix_cache=True)
    assert refusal(request) is None
    assert arrival(request, seq_id=1, t0=0.0).skip_prefix_hit is True
    assert arrival(_request(), seq_id=2, t0=0.0).skip_prefix_hit is False


def test_vllm_request_for_a_single_token_is_served_and_for_none_is_refused():
    assert refusal(_request(max_tokens=1)) is None
    assert "max_tokens must be at least 1" in (refusal(_request(max_tokens=0)) or "")


def test_vllm_stop_rule_eos_then_stop_tokens_then_length():
    eos = stop_rule(_request(sampling_params=_params(eos_token_id=9, stop_token_ids=[9, 11])), 2048)
    assert stop_reason(eos, 9, 1) == ("stop", None)  # eos first, though it is a stop token too
    assert stop_reason(eos, 11, 1) == ("stop_token", 11)
    assert stop_reason(eos, 12, 1) is None
    assert stop_reason(eos, 12, 4) == ("length", None)  # max_tokens 4
    assert stop_reason(stop_rule(_request(), 2048), 12, 1) is None
    near_end = stop_rule(_request(max_tokens=100), 5)  # a 3-token prompt, context of 5
    assert stop_reason(near_end, 12, 1) is None and stop_reason(near_end, 12, 2) == ("length", None)


def test_a_hybrid_vllm_cache_is_split_into_kv_blocks_and_state_blocks_per_mamba_group():
    kv = _kv_cache(MambaSpec, FullAttentionSpec, MambaSpec, num_blocks=1001)
    config = cfg.scheduler_config(_vllm_config(max_num_batched_tokens=2048), kv, 544)

    assert config.hybrid and config.checkpoints.aligned_only
    states = 2 * (config.max_batch + config.checkpoints.budget)
    assert config.num_blocks - 1 + states == 1000  # every vLLM id but the null block
    assert cfg.groups(kv) == (1, [0, 2])


def test_a_hybrid_cache_too_small_for_the_states_is_refused():
    with pytest.raises(cfg.UnsupportedConfig, match="give vLLM more KV cache memory"):
        cfg.scheduler_config(
            _vllm_config(max_num_batched_tokens=2048),
            _kv_cache(FullAttentionSpec, MambaSpec, num_blocks=10),
            544,
        )


def test_vllm_release_the_adapter_is_tested_against_starts_with_or_without_a_build_label():
    assert cfg.check_vllm_version(cfg.TESTED_VLLM, False) is None
    assert cfg.check_vllm_version(cfg.TESTED_VLLM + "+cpu", False) is None


def test_vllm_other_release_is_refused_at_start_up_naming_both_releases_and_the_opt_in():
    with pytest.raises(cfg.UnsupportedConfig) as refused:
        cfg.check_vllm_version("0.33.1", False)
    message = str(refused.value)
    assert cfg.TESTED_VLLM in message and "0.33.1" in message
    assert "allow_untested_vllm" in message and cfg.UNTESTED_ENV in message


def test_vllm_other_release_starts_with_a_warning_when_allowed_by_option_or_environment(
    monkeypatch,
):
    monkeypatch.delenv(cfg.UNTESTED_ENV, raising=False)
    vc = _vllm_config()
    assert cfg.options(vc)["allow_untested_vllm"] is False
    vc.additional_config = {"kvsched": {"allow_untested_vllm": True}}
    allowed = cfg.options(vc)["allow_untested_vllm"]
    warning = cfg.check_vllm_version("0.31.2", allowed)
    assert warning is not None and "0.31.2" in warning and cfg.TESTED_VLLM in warning
    monkeypatch.setenv(cfg.UNTESTED_ENV, "1")
    assert cfg.options(_vllm_config())["allow_untested_vllm"] is True
    vc.additional_config = {"kvsched": {"allow_untested_vllm": "yes"}}
    with pytest.raises(cfg.UnsupportedConfig, match="allow_untested_vllm must be"):
        cfg.options(vc)


def test_vllm_requests_with_min_tokens_are_served_and_keep_vllms_stop_order():
    request = _request(sampling_params=_params(min_tokens=3, eos_token_id=9))
    assert refusal(request) is None
    rule = stop_rule(request, max_model_len=64)
    assert stop_reason(rule, 9, 1) == ("stop", None)  # (vLLM checks eos before min_tokens)
    off = _params(repetition_detection=NS(max_pattern_size=0))  # 0: detection is off
    assert refusal(_request(sampling_params=off)) is None


@pytest.mark.parametrize(
    "line, message",
    [
        ("not json", "must be a JSON object"),
        ("[1, 2]", "must be a JSON object"),
        ('{"id": "a", "prompt": [1], "max_tokens": 1, "x": 2}', r"unknown request keys \['x'\]"),
        ('{"id": "", "prompt": [1], "max_tokens": 1}', "'id' must be a non-empty string"),
        ('{"id": "a", "prompt": [], "max_tokens": 1}', "'prompt' must be a non-empty list"),
        ('{"id": "a", "prompt": [1, -2], "max_tokens": 1}', "'prompt' must be"),
        ('{"id": "a", "prompt": [1], "max_tokens": 0}', "'max_tokens' must be an int >= 1"),
        ('{"id": "a", "prompt": [1], "max_tokens": true}', "'max_tokens' must be"),
        ('{"id": "a", "prompt": [1], "max_tokens": 2, "kv_transfer_params": 3}', "an object"),
    ],
)
def test_vllm_disaggregation_engine_refuses_a_bad_request_line_naming_what_is_wrong(line, message):
    """A disaggregation engine answers such a line with ``{"id", "error"}`` and goes on."""
    from kvsched.integrations.vllm.disagg import parse_request

    with pytest.raises(ValueError, match=message):
        parse_request(line)


def test_vllm_disaggregation_engine_reads_a_good_request_line():
    from kvsched.integrations.vllm.disagg import parse_request

    line = '{"id": "7", "prompt": [3, 4], "max_tokens": 2, "kv_transfer_params": {"k": 1}}'
    assert parse_request(line) == {
        "id": "7",
        "prompt": [3, 4],
        "max_tokens": 2,
        "kv_transfer_params": {"k": 1},
    }
