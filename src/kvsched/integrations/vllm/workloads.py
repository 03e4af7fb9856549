"""Acceptance workloads for kvsched's caching inside vLLM (``run.py --workload chat``).

``chat``: a long shared system prompt; a burst of users arriving together, each with a
question mostly longer than a block (the branches off the system prompt); second turns of
two of them (their first prompt, its answer and a follow-up) arriving together with new
users; strangers (prompts sharing nothing), each alone; then one more user alone. Run with a
small ``--blocks`` it is the memory-pressure workload: blocks and states are evicted between
the waves. Greedy, ``ignore_eos``, token ids.
"""

from __future__ import annotations

from typing import Any

import numpy as np

# (system prompt, shortest and longest question, follow-up, a stranger's prompt) in tokens:
# attention models (block 32) and hybrid ones (the block is vLLM's state page, 544-640 tokens
# here), each a few blocks so that hits, chunk cuts and branch points fall on different
# blocks; a stranger (no shared prefix) is two blocks and a bit.
CHAT_SIZES = {"attention": (300, 20, 110, 50, 70), "hybrid": (1400, 300, 900, 600, 1300)}
STRANGERS = 3
USERS = 7  # the burst (the seven prompts submitted together)
ANSWER = 8  # tokens generated per request


def _tokens(n: int, seed: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(3, 500, n)]


def chat(llm: Any, out: dict[str, Any], sizes: tuple[int, int, int, int, int]) -> None:
    """Run the ``chat`` workload on ``llm``; each request's tokens and cached tokens into
    ``out`` by name, in submission order."""
    from vllm import SamplingParams, TokensPrompt

    system, short, long, follow, stranger = sizes
    prompt = _tokens(system, 21)
    rng = np.random.default_rng(22)
    lengths = rng.integers(short, long + 1, 2 * USERS + 1).tolist()
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=ANSWER)

    def wave(prompts: dict[str, list[int]]) -> None:
        results = llm.generate(
            [TokensPrompt(prompt_token_ids=p) for p in prompts.values()], params, use_tqdm=False
        )
        for name, r in zip(prompts, results, strict=True):
            out[name] = {
                "tokens": list(r.outputs[0].token_ids),
                "cached": r.num_cached_tokens or 0,
                "prompt": len(prompts[name]),
            }

    first = {f"user-{i}": prompt + _tokens(lengths[i], 100 + i) for i in range(USERS)}
    wave(first)
    second: dict[str, list[int]] = {}
    for i in (1, 3):  # a second turn: the first prompt, its answer, a follow-up
        answer = out[f"user-{i}"]["tokens"]
        second[f"user-{i}-turn-2"] = [*first[f"user-{i}"], *answer, *_tokens(follow, 200 + i)]
    second.update(
        {f"user-{i}": prompt + _tokens(lengths[i], 100 + i) for i in range(USERS, USERS + 3)}
    )
    wave(second)
    for i in range(STRANGERS):  # their blocks and states push the shared ones out
        wave({f"stranger-{i}": _tokens(stranger, 300 + i)})
    wave({"user-last": prompt + _tokens(lengths[-1], 150)})


