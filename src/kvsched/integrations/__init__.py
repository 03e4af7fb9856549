"""Adapters that let a serving engine run kvsched as its scheduler."""
