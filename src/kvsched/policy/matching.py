"""Prefix and checkpoint matching: the longest usable cached prefix of a request (pure queries).

A hit never covers the last known token (it is recomputed for the next logits), and never
ends inside a multimodal span (``spans.py``: it is rewound out of the span and rounded down
to a block). An attention model's hit is the cached prefix of the request's hash chain
(binary search of the prefix index). A hybrid model's hit is usable only up to the deepest
published state checkpoint on the chain: KV without a state is a miss. A request that asks
for routed-expert ids stops at the first cached block without them.

MTP (``num_speculative_tokens`` > 0): the draft model's KV row of a hit's last cached
position depends on the token after it, which the request need not share with the block's
producer, so the last cached block of a hit is recomputed (``mtp_overlap`` "one_block", as
lmdeploy): into a private block, while the sequence holds the cached block (``Match.overlap``)
so that it stays shared and cached, and the sequence's later blocks chain from it. A hybrid
hit needs cached KV one block beyond its checkpoint (that block is the overlap). Logs before
schema 4 recomputed the last k blocks instead ("k_blocks").
"""

from __future__ import annotations

from kvsched.config import SchedulerConfig
from kvsched.identity import partial_key, tail_extra
from kvsched.policy import spans
from kvsched.policy.common import NO_MATCH, Match, cdiv
from kvsched.reducers.checkpoints import Checkpoint
from kvsched.reducers.sequences import Seq
from kvsched.reducers.state import EngineState


class Matcher:
    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self.bs = config.block_size
        self._recompute = config.mtp_recompute_blocks  # (read once: derived properties)
        self._holds_overlap = config.mtp_holds_overlap
        self._whole = spans.kept_whole(config)  # (no hit or load ends inside a span)
        # (a checkpoint inside a span is never restored, in logs before schema 4 too, unless
        # the executor keeps a span's encoder output across chunks)
        self._states_whole = not config.model.span_slices

    def find_prefix(self, state: EngineState, seq: Seq) -> Match:
        """Tentative match: the longest usable cached prefix (nothing is emitted)."""
        if not self.config.enable_prefix_caching or seq.skip_hit:
            return NO_MATCH
        if state.hybrid:
            return self._find_checkpoint(state, seq)
        if not self.config.legacy.multimodal_safe:
            return self._find_prefix_before_schema4(state, seq)
        pool, bs = state.pool, self.bs
        mm_spans = seq.mm_spans if self._whole else ()
        blocks = pool.cached_prefix(seq.hashes, (seq.n_tokens - 1) // bs)
        depth = len(blocks)
        if seq.want_experts:  # a block without routed-expert ids ends the match
            depth = pool.count_with_experts(blocks)
        if mm_spans:  # (rewound out of multimodal spans)
            depth = spans.safe_depth(mm_spans, depth, bs)
        hit = depth
        if self._recompute and depth:
            hit = depth - self._recompute
            if mm_spans:
                hit = spans.safe_depth(mm_spans, hit, bs)
        overlap = int(blocks[hit]) if hit < depth and self._holds_overlap else 0
        return Match(hit * bs, blocks[:hit], overlap=overlap)

    def _find_prefix_before_schema4(self, state: EngineState, seq: Seq) -> Match:
        """Logs before schema 4: a hit may end inside a multimodal span."""
        pool, bs = state.pool, self.bs
        found = pool.cached_prefix(seq.hashes, (seq.n_tokens - 1) // bs)
        cached = len(found)
        # MTP: the last k cached blocks are recomputed (into private blocks, which caching
        # then swaps for the canonical ones) so a draft head gets hidden states.
        depth = max(0, cached - self._recompute)
        if seq.want_experts:  # a block without routed-expert ids ends the match
            depth = pool.count_with_experts(found[:depth])
        blocks = found[:depth]
        overlap = self._overlap(state, seq, depth) if depth < cached else 0
        return Match(depth * bs, blocks, overlap=overlap)

    def safe_depth(self, seq: Seq, depth: int) -> int:
        """``depth`` blocks, rewound out of multimodal spans (``multimodal_safe``)."""
        if not seq.mm_spans or not self._whole:
            return depth
        return spans.safe_depth(seq.mm_spans, depth, self.bs)

    def _overlap(self, state: EngineState, seq: Seq, depth: int) -> int:
        """MTP: the cached block after a hit of ``depth`` blocks that the sequence recomputes
        privately and holds (0 when it holds none)."""
        if not self._holds_overlap or depth >= len(seq.hashes):
            return 0
        return state.pool.cached_block(seq.hashes[depth]) or 0

    def _find_checkpoint(self, state: EngineState, seq: Seq) -> Match:
        """The deepest usable checkpoint. With MTP, the cached KV must reach beyond the
        checkpoint's anchor by the blocks MTP recomputes."""
        limit = seq.n_tokens - 1
        top = limit // self.bs
        k = self._recompute
        fast = not k and not seq.want_experts
        hit = self.checkpoint_at(state, seq, top, limit) if fast else None
        kv_depth = top
        if hit is None:
            pool = state.pool
            kv = pool.cached_prefix(seq.hashes, top)
            kv_depth = len(kv)
            deepest = min(kv_depth - k, top - 1 if fast else top)
            if seq.want_experts:  # a block without routed-expert ids ends the match
                deepest = min(deepest, pool.count_with_experts(kv))
            for depth in range(deepest, -1, -1):
                hit = self.checkpoint_at(state, seq, depth, limit)
                if hit is not None:
                    break
        if hit is None:
            return Match(0, NO_MATCH.blocks, -1, kv_depth * self.bs)
        overlap = self._overlap(state, seq, hit.step // self.bs)
        return Match(hit.step, hit.path, hit.ckpt_id, kv_depth * self.bs, overlap)

    def checkpoint_at(
        self, state: EngineState, seq: Seq, depth: int, limit: int
    ) -> Checkpoint | None:
        """The deepest usable checkpoint anchored at block ``depth`` (partial tails first)."""
        ckpts, bs = state.ckpts, self.bs
        anchor = seq.hashes[depth - 1] if depth else seq.root
        tails_usable = not seq.want_experts and self._fits_beside_a_frozen_tail(seq)
        tails = ckpts.find_partials(anchor) if tails_usable else {}
        for step in sorted(tails, reverse=True) if tails else ():
            if step <= limit and (
                not self._states_whole or spans.boundary_safe(seq.mm_spans, step)
            ):
                extra = tail_extra(seq.mm_spans, depth * bs, step)
                partial = ckpts.find(partial_key(anchor, seq.tokens[depth * bs : step], extra))
                if partial is not None:
                    return partial
        if depth:
            aligned = ckpts.find(anchor)
            if aligned is not None and (
                not self._states_whole or spans.boundary_safe(seq.mm_spans, aligned.step)
            ):
                return aligned
        return None

    def _fits_beside_a_frozen_tail(self, seq: Seq) -> bool:
        """Whether ``seq`` fits the cache alone beside a partial checkpoint's frozen tail
        block, which the checkpoint holds (pinned by the sequence, so never evicted) while
        the sequence runs, and (MTP) the cached block it holds beside its recompute. Else a
        partial hit would have it preempted for that block and matched to the same
        checkpoint again, forever: it takes an aligned one."""
        longest = min(seq.n_prompt + seq.max_tokens, self.config.model.max_context)
        held = 1 + int(self._holds_overlap)
        return cdiv(longest, self.bs) + held <= self.config.num_blocks - 1

    def deeper_state_in_flight(self, state: EngineState, seq: Seq, hit: int) -> bool:
        """(overlapped steps) Whether a step still out saves a state on ``seq``'s prefix
        deeper than its hit of ``hit`` tokens: it is published once that step's outcome
        lands (within two steps), and the sequence waits for it rather than recompute what
        it covers (as vLLM, whose hybrid requests wait for a state cached in the step)."""
        if not state.hybrid:
            return False
        bs, limit = self.bs, seq.n_tokens - 1
        return any(  # (an aligned checkpoint's identity is its last block's hash)
            hit < step <= limit and not step % bs and seq.hashes[step // bs - 1] == key
            for step, key in state.ckpts.in_flight()
        )
