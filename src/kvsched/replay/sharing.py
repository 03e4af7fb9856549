"""Prefix-sharing models for traces that carry arrivals and lengths but no prefix identity
(the Azure traces): an explicit, seeded, opt-in model of which requests share which prefix.

Without one (the default), every Azure request gets tokens of its own and nothing is shared.
``--sharing code-edit`` (``CodeEdit``) keeps each request's arrival time and prompt length
exactly and assigns its tokens by a model of code-completion traffic: users editing files in
repositories. A request belongs to a user (drawn uniformly); a user works in one repository
(drawn by a Zipf popularity); its prompt is the repository's shared context (a system prompt
and repository snippets, the same for every user of the repository), then the user's current
file up to the cursor. A user's next request stays in the same file with probability
``same_file_p``: it keeps the previous file prefix except the last ``edit`` tokens (the region
just edited; geometric with mean ``edit_tokens_mean``) and continues with new tokens to its
own length; otherwise it opens another file (all new tokens after the repository context).
Prompts shorter than the repository context are its prefix. The same seed gives the same
tokens; every parameter's source: ``CodeEdit``'s comments and docs/replay.md.
"""

from __future__ import annotations

import attrs
import numpy as np

from kvsched.replay.shapes import ShapeError, parse_params

SHARING_MODELS = ("none", "code-edit")
"""``--sharing`` models: none (the default: nothing shared) and code-edit."""


@attrs.frozen
class CodeEdit:
    """The parameters of ``--sharing code-edit``; none tuned on a replay (see each comment)."""

    # Concurrent users: 8,819 requests over 3,436 s is 2.6 requests/s; a completion service
    # asks at most every few seconds per user while typing (debounced), 30 s on average
    # between a user's requests gives about 64 users; a round value.
    users: int = 64
    # Repositories the users work in, with Zipf popularity (exponent 1.0, as the chat
    # shape's system prompts); round values.
    repos: int = 8
    repo_zipf: float = 1.0
    # The shared context of a repository (system prompt + snippets of its other files, as
    # Copilot-style prompts are built): 1,024 tokens; the trace's median ContextTokens is
    # about 1,900, so the file prefix is the larger part of a typical prompt. A round value.
    repo_tokens: int = 1024
    # A user's next request stays in the same file with this probability (a round value:
    # completions follow typing, file switches are rarer).
    same_file_p: float = 0.8
    # Tokens edited at the end of the kept file prefix since the last request (geometric
    # mean; a few lines of code); a round value.
    edit_tokens_mean: float = 64.0
    vocab_size: int = 150_000

    def check(self) -> None:
        """ShapeError naming the first parameter out of range."""
        for name in ("users", "repos"):
            if getattr(self, name) < 1:
                raise ShapeError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.repo_tokens < 0:
            raise ShapeError(f"repo_tokens must be >= 0, got {self.repo_tokens}")
        if not 0.0 <= self.same_file_p <= 1.0:
            raise ShapeError(f"same_file_p must be in [0, 1], got {self.same_file_p}")
        if not self.edit_tokens_mean >= 1.0:
            raise ShapeError(f"edit_tokens_mean must be >= 1, got {self.edit_tokens_mean}")
        if self.vocab_size < 2:
            raise ShapeError(f"vocab_size must be >= 2, got {self.vocab_size}")


def sharing_model(name: str, spec: str | None, vocab_size: int) -> CodeEdit | None:
    """The model ``--sharing name`` with the ``--shape-param`` ``spec``; None for "none"."""
    if name not in SHARING_MODELS:
        raise ShapeError(f"--sharing {name!r}: not one of {', '.join(SHARING_MODELS)}")
    if name == "none":
        if spec:
            raise ShapeError("--shape-param: the sharing model 'none' has no parameters")
        return None
    params: CodeEdit = parse_params(CodeEdit, spec, vocab_size=vocab_size)
    return params


def code_edit_prompts(model: CodeEdit, lengths: list[int], seed: int) -> list[np.ndarray]:
    """The prompt tokens of requests of ``lengths`` (in arrival order) under ``model``."""
    rng = np.random.default_rng([seed, 0xC0DE])
    ranks = np.arange(1, model.repos + 1, dtype=np.float64) ** -model.repo_zipf
    repo_of = rng.choice(model.repos, size=model.users, p=ranks / ranks.sum())
    repos = [
        rng.integers(1, model.vocab_size, model.repo_tokens, dtype=np.int32)
        for _ in range(model.repos)
    ]
    files: list[np.ndarray | None] = [None] * model.users  # each user's current file prefix
    out: list[np.ndarray] = []
    for n in lengths:
        user = int(rng.integers(0, model.users))
        context = repos[int(repo_of[user])][:n]
        want = n - len(context)
        current = files[user]
        keep = 0
        if current is not None and rng.random() < model.same_file_p:
            edit = int(rng.geometric(1.0 / model.edit_tokens_mean))
            keep = max(0, min(len(current), want) - edit)
        fresh = rng.integers(1, model.vocab_size, want - keep, dtype=np.int32)
        mine = np.concatenate([current[:keep], fresh]) if current is not None else fresh
        files[user] = mine
        out.append(np.concatenate([context, mine]))
    return out
