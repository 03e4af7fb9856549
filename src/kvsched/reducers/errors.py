"""Errors of the folds, and the reference changes a holder's fold hands to the block pool."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np


class InvariantError(AssertionError):
    """State that breaks an owner's invariant."""


class ReplayMismatch(RuntimeError):
    """An event that cannot be folded into the current state."""


class RefChange(NamedTuple):
    """What a holder's fold did to its block references: ``attach`` arrays (one reference on
    each block) are applied first, then ``release`` arrays, in order (each in block-table
    order, root first). Holders (sequences, sessions, checkpoints, save leases) own *which*
    blocks they hold; the block pool owns the counts, and ``EngineState`` hands every change
    to it. (A named tuple: one is built per fold that touches references.)"""

    attach: tuple[np.ndarray, ...] = ()
    release: tuple[np.ndarray, ...] = ()
