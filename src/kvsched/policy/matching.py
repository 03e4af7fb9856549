"""Prefix and checkpoint matching: the longest usable cached prefix of a request (pure queries).

A hit never covers the last known token (it is recomputed for the next logits). An attention
model's hit is the cached prefix of the request's hash chain (binary search of the prefix
index). A hybrid model's hit is usable only up to the deepest published state checkpoint on
the chain: KV without a state is a miss. With MTP (k speculative tokens) the last k cached
blocks of a hit are recomputed; a request that asks for routed-expert ids stops at the first
cached block without them.
"""

from __future__ import annotations

from kvsched.config import SchedulerConfig
from kvsched.identity import partial_key, tail_extra
from kvsched.policy.common import NO_MATCH, Match
from kvsched.reducers.checkpoints import Checkpoint
from kvsched.reducers.sequences import Seq
from kvsched.reducers.state import EngineState


class Matcher:
    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self.bs = config.block_size

    def find_prefix(self, state: EngineState, seq: Seq) -> Match:
        """Tentative match: the longest usable cached prefix (nothing is emitted)."""
        if not self.config.enable_prefix_caching:
            return NO_MATCH
        if state.hybrid:
            return self._find_checkpoint(state, seq)
        pool, bs = state.pool, self.bs
        depth = pool.find_prefix_len(seq.hashes, (seq.n_tokens - 1) // bs)
        # MTP: the last k cached blocks are recomputed (into private blocks, which caching
        # then swaps for the canonical ones) so a draft head gets hidden states.
        depth = max(0, depth - self.config.num_speculative_tokens)
        blocks = pool.find_blocks(seq.hashes, depth)
        if seq.want_experts:  # a block without routed-expert ids ends the match
            depth = pool.count_with_experts(blocks)
            blocks = blocks[:depth]
        return Match(depth * bs, blocks)

    def _find_checkpoint(self, state: EngineState, seq: Seq) -> Match:
        """The deepest usable checkpoint. With MTP (k speculative tokens), the cached KV must
        reach k blocks beyond the checkpoint's anchor: those blocks are recomputed."""
        limit = seq.n_tokens - 1
        top = limit // self.bs
        k = self.config.num_speculative_tokens
        fast = not k and not seq.want_experts
        hit = self.checkpoint_at(state, seq, top, limit) if fast else None
        kv_depth = top
        if hit is None:
            pool = state.pool
            kv_depth = pool.find_prefix_len(seq.hashes, top)
            deepest = min(kv_depth - k, top - 1 if fast else top)
            if seq.want_experts:  # a block without routed-expert ids ends the match
                covered = pool.count_with_experts(pool.find_blocks(seq.hashes, kv_depth))
                deepest = min(deepest, covered)
            for depth in range(deepest, -1, -1):
                hit = self.checkpoint_at(state, seq, depth, limit)
                if hit is not None:
                    break
        if hit is None:
            return Match(0, NO_MATCH.blocks, -1, kv_depth * self.bs)
        return Match(hit.step, hit.path, hit.ckpt_id, kv_depth * self.bs)

    def checkpoint_at(
        self, state: EngineState, seq: Seq, depth: int, limit: int
    ) -> Checkpoint | None:
        """The deepest usable checkpoint anchored at block ``depth`` (partial tails first)."""
        ckpts, bs = state.ckpts, self.bs
        anchor = seq.hashes[depth - 1] if depth else seq.root
        tails = ckpts.find_partials(anchor) if not seq.want_experts else {}
        for step in sorted(tails, reverse=True) if tails else ():
            if step <= limit and boundary_safe(seq, step):
                extra = tail_extra(seq.mm_spans, depth * bs, step)
                partial = ckpts.find(partial_key(anchor, seq.tokens[depth * bs : step], extra))
                if partial is not None:
                    return partial
        if depth:
            aligned = ckpts.find(anchor)
            if aligned is not None and (not seq.mm_spans or boundary_safe(seq, aligned.step)):
                return aligned
        return None


def boundary_safe(seq: Seq, step: int) -> bool:
    """A checkpoint never sits inside a multimodal span."""
    return all(not span.start < step < span.end for span in seq.mm_spans)
