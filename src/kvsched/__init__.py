"""kvsched: an event-sourced scheduler with explicit state machines for hybrid LLM serving."""

__version__ = "0.2.0"
