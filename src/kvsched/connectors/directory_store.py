"""``DirectoryStore``: a ``KVStore`` in a directory, one file per key, shared by processes.

It is the store two engines on one machine share without a server (a fresh engine loads
what an earlier one saved; a prefill engine and a decode engine side by side). Values are
written to a temporary file and renamed into place, so a reader sees a whole value or none;
the first writer wins (a rename never replaces a present key). Nothing is evicted: a
directory store is as large as its disk (remove keys, or the directory, to free it). A
directory that is gone or unreadable is ``StoreUnavailable``, as a store that stopped.
"""

from __future__ import annotations

import hashlib
import os
import threading
from collections.abc import Sequence
from pathlib import Path

from kvsched.connectors.errors import StoreUnavailable

__all__ = ["DirectoryStore"]


class DirectoryStore:
    def __init__(self, path: str | os.PathLike[str], create: bool = True) -> None:
        self.path = Path(path)
        if create:
            self.path.mkdir(parents=True, exist_ok=True)
        self._check()
        self._seq = 0
        self._lock = threading.Lock()

    def _check(self) -> None:
        if not self.path.is_dir():
            raise StoreUnavailable(f"store directory {self.path} is missing")

    def _file(self, key: str) -> Path:
        # (keys are long and contain "/": a digest names the file, a 2-hex subdirectory
        # keeps directories small)
        name = hashlib.sha256(key.encode()).hexdigest()
        return self.path / name[:2] / name

    def batch_exists(self, keys: Sequence[str]) -> list[bool]:
        self._check()
        return [self._file(k).exists() for k in keys]

    def put_many(self, items: Sequence[tuple[str, bytes]]) -> None:
        self._check()
        for key, value in items:
            if not value:
                raise ValueError(f"empty value for {key}")
            target = self._file(key)
            if target.exists():
                continue  # (first writer wins)
            with self._lock:
                self._seq += 1
                tmp = target.with_name(f".{target.name}.{os.getpid()}.{self._seq}.tmp")
            try:
                target.parent.mkdir(exist_ok=True)
                tmp.write_bytes(value)
                if not target.exists():
                    os.replace(tmp, target)
            except OSError as exc:
                raise StoreUnavailable(f"cannot write {key} under {self.path}: {exc}") from exc
            finally:
                tmp.unlink(missing_ok=True)

    def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        self._check()
        out: list[bytes | None] = []
        for key in keys:
            try:
                out.append(self._file(key).read_bytes())
            except FileNotFoundError:
                out.append(None)
            except OSError as exc:
                raise StoreUnavailable(f"cannot read {key} under {self.path}: {exc}") from exc
        return out

    def remove(self, keys: Sequence[str]) -> None:
        for key in keys:
            self._file(key).unlink(missing_ok=True)

    def close(self) -> None:
        pass
