"""``Closing``: a context manager that closes its object on exit (logs, stream sockets)."""

from __future__ import annotations

from types import TracebackType
from typing import Self


class Closing:
    """Mixin: ``with obj:`` calls ``obj.close()`` on exit (``close`` must be idempotent)."""

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
