"""The checkpoint rules and named policies a config can name: placement rules, eviction
orders, the named rule sets (``CHECKPOINT_POLICIES``) and a named policy's engine settings.
``kvsched.config`` re-exports them; they are plain data (no imports from kvsched)."""

from __future__ import annotations

from typing import Any

# Where a hybrid model saves state checkpoints (each a declared, named rule; policy/README.md):
PLACEMENTS: tuple[str, ...] = (
    "chunk_end",  # block-aligned ends of prefill chunks (lmdeploy)
    "prompt_end",  # the prompt end, its partial block frozen (lmdeploy)
    "prompt_tail",  # the last block boundary before the prompt's last token (vLLM "align")
    "interval",  # every Checkpoints.interval tokens inside prefill chunks (vLLM "all" mode)
    "branch",  # where a request's cached KV runs past its deepest state (Marconi, SGLang)
    "sequence_end",  # the end of every finished sequence, prompt plus output (SGLang)
    "session_end",  # the end of a finished sequence of a session (its next turn resumes there)
    "decode",  # every Checkpoints.decode_interval decode tokens, all kept
    "decode_blocks",  # every block boundary a decode step reaches, all kept (vLLM "align")
    "decode_latest",  # at block boundaries in decode, each replacing the sequence's previous
    "oracle",  # where a later request's hit ends (its recorded future: trace replays only)
)
# Which checkpoint an eviction drops (policy/eviction.py): least recently used; frozen partial
# tails first, then least recently used (lmdeploy); or the lowest value (prefill compute a hit
# saves per byte of state, times its hits squared, aged: greedy-dual-size-frequency),
# declining a new checkpoint worth less than every one it would replace; "oracle": Belady's.
EVICTIONS: tuple[str, ...] = ("lru", "frozen_first", "value", "oracle")
# Named checkpoint policies (Checkpoints fields): kvsched's own, and baselines that behave
# like its peers. "lmdeploy" places no "decode" checkpoints: its decode interval was 0 and
# nothing could set it, so that rule never saved one (docs/checkpoints.md).
CHECKPOINT_POLICIES: dict[str, dict[str, Any]] = {
    "kvsched": {
        "placement": (
            "chunk_end",
            "prompt_end",
            "prompt_tail",
            "interval",
            "branch",
            "session_end",
        ),
        "eviction": "value",
        "aligned_only": False,
        "min_gain_blocks": 1,
    },
    "lmdeploy": {
        "placement": ("chunk_end", "prompt_end"),
        "eviction": "frozen_first",
        "aligned_only": False,
        "min_gain_blocks": 0,
    },
    # vLLM 0.32's "align" mode, defaults (docs/vllm.md, "The vllm-align preset against vLLM
    # 0.32"): states at block boundaries only, a chunk stopping at each save point
    # (Scheduler._mamba_block_aligned_split): the prompt tail, the shared-prefix junction
    # (get_computed_blocks' shared_prefix_boundary); LRU (the block pool's free queue). With
    # prefix_cache_retention_interval=0 (its default) vLLM hashes no other state, so no
    # "chunk_end" (an interior chunk end) and no "decode_blocks" (test_vllm_fidelity).
    "vllm-align": {
        "placement": ("prompt_tail", "branch"),
        "eviction": "lru",
        "aligned_only": True,
        "mid_chunk_saves": False,
        "min_gain_blocks": 0,
    },
    # The vLLM adapter's (integrations/vllm/config.py): the rules vLLM's runner can realise
    # (docs/vllm.md), kvsched's eviction; with POLICY_ENGINE_SETTINGS' caching at planning.
    "vllm-kvsched": {
        "placement": ("chunk_end", "prompt_tail", "branch", "decode_blocks"),
        "eviction": "value",
        "aligned_only": True,
        "mid_chunk_saves": False,
    },
    # SGLang's MambaRadixCache as notes/peers-2026.md describes it (late 2026, not run here):
    # the state at each chunk end (cache_unfinished_req), at every finished sequence's end
    # (cache_finished_req), at full-KV branching points (sglang#31181); LRU, a hit refreshing
    # only the state it consumed (sglang#31643).
    "sglang": {
        "placement": ("chunk_end", "branch", "sequence_end"),
        "eviction": "lru",
        "aligned_only": False,
        "min_gain_blocks": 0,
    },
    # An upper reference that knows the trace's future (replay/future.py, docs/checkpoints.md).
    "oracle": {
        "placement": ("oracle",),
        "eviction": "oracle",
        "aligned_only": False,
        "min_gain_blocks": 0,
    },
}

# A named policy's SchedulerConfig fields beyond its checkpoint rules.
POLICY_ENGINE_SETTINGS: dict[str, dict[str, Any]] = {
    "vllm-kvsched": {
        "cache_when_planned": True,
        "dedup_cached_blocks": False,
        "admit_after_preemption": False,
        "preempt_latest_entered": True,
    },
}
