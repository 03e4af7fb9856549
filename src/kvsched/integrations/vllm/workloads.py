"""Acceptance workloads for kvsched's caching inside vLLM (``run.py --workload chat``).

``chat``: a long shared system prompt; a burst of users arriving together, each with a
question mostly longer than a block (the branches off the system prompt); second turns of
two of them (their first prompt, its answer and a follow-up) arriving together with new
users; strangers (prompts sharing nothing), each alone; then one more user alone. Run with a
small ``--blocks`` it is the memory-pressure workload: blocks and states are evicted between
the waves. Greedy, ``ignore_eos``, token ids.

``popular``: a popular shared prefix (users one after another, each hitting the state the
first one left at the prefix's last whole block), then strangers one after another, each
leaving a state of its own and little KV, then more users of the shared prefix. Run with a
pool that the strangers' KV blocks and states overflow together but their KV blocks alone
do not, it is the state-pressure workload: vLLM's one LRU pool drops the shared state,
kvsched's value eviction keeps it (docs/vllm.md).
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
# popular (hybrid only): (shared prefix, shortest and longest question, stranger) in tokens,
# block 640: the prefix is two whole blocks and a bit, a question ends the prompt inside the
# third block (the prompt tail is the shared state), a stranger is one block and a bit
# (one cached KV block and one state each).
POPULAR_SIZES = (1400, 30, 200, 800)
POPULAR_USERS = (3, 3)  # users of the shared prefix before and after the strangers
POPULAR_STRANGERS = 10
USERS = 7  # the burst (the seven prompts submitted together)
ANSWER = 8  # tokens generated per request


def _tokens(n: int, seed: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(3, 500, n)]


def chat(llm: Any, out: dict[str, Any], sizes: tuple[int, int, int, int, int]) -> None:
    """Run the ``chat`` workload on ``llm``; each request's tokens and cached tokens into
    ``out`` by name, in submission order."""
    system, short, long, follow, stranger = sizes
    prompt = _tokens(system, 21)
    rng = np.random.default_rng(22)
    lengths = rng.integers(short, long + 1, 2 * USERS + 1).tolist()

    def wave(prompts: dict[str, list[int]]) -> None:
        _wave(llm, out, prompts)

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


def _wave(llm: Any, out: dict[str, Any], prompts: dict[str, list[int]]) -> None:
    """One ``LLM.generate`` call of ``prompts`` (greedy, ``ANSWER`` tokens each); each
    request's tokens, cached tokens and prompt length into ``out`` by name."""
    from vllm import SamplingParams, TokensPrompt

    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=ANSWER)
    results = llm.generate(
        [TokensPrompt(prompt_token_ids=p) for p in prompts.values()], params, use_tqdm=False
    )
    for name, r in zip(prompts, results, strict=True):
        out[name] = {
            "tokens": list(r.outputs[0].token_ids),
            "cached": r.num_cached_tokens or 0,
            "prompt": len(prompts[name]),
        }


def popular(llm: Any, out: dict[str, Any], sizes: tuple[int, int, int, int]) -> None:
    """Run the ``popular`` workload on ``llm``: users of one shared prefix, strangers, then
    users again, each request alone."""
    shared, short, long, stranger = sizes
    prefix = _tokens(shared, 31)
    before, after = POPULAR_USERS
    lengths = np.random.default_rng(32).integers(short, long + 1, before + after).tolist()
    for i in range(before):
        _wave(llm, out, {f"user-{i}": prefix + _tokens(lengths[i], 500 + i)})
    for i in range(POPULAR_STRANGERS):
        _wave(llm, out, {f"stranger-{i}": _tokens(stranger, 600 + i)})
    for i in range(before, before + after):
        _wave(llm, out, {f"user-{i}": prefix + _tokens(lengths[i], 500 + i)})
