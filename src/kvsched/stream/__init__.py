"""Following a run's event stream from outside the engine: the cache view it rebuilds, the
engine-side view to compare it with, and ``kvsched watch``."""

from kvsched.stream.view import CacheView, SeqView, engine_view

__all__ = ["CacheView", "SeqView", "engine_view"]
