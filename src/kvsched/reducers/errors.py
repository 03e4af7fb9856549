"""Errors of the folds, and the reference changes a holder's fold hands to the block pool."""

from __future__ import annotations

import attrs
import numpy as np


class InvariantError(AssertionError):
    """State that breaks an owner's invariant."""


class ReplayMismatch(RuntimeError):
    """An event that cannot be folded into the current state."""


@attrs.frozen
class RefChange:
    """What a holder's fold did to its block references: ``attach`` arrays (one reference on
    each block) are applied first, then ``release`` arrays, in order (each in block-table
    order, root first). Holders (sequences, sessions, checkpoints, save leases) own *which*
    blocks they hold; the block pool owns the counts, and ``EngineState`` hands every change
    to it."""

    attach: tuple[np.ndarray, ...] = ()
    release: tuple[np.ndarray, ...] = ()


NO_CHANGE = RefChange()
