"""kvsched: an event-sourced scheduler with explicit state machines for hybrid LLM serving."""

__version__ = "0.1.0"
SCHEMA_VERSION = 1
