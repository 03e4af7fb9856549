"""``DirectoryStore`` (a ``KVStore`` in a directory, shared by processes) and fault drills
(``DrillStore``), alone and under the worker's ``TransferEngine``."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvsched.connectors.buffers import HostBlockBuffer
from kvsched.connectors.directory_store import DirectoryStore
from kvsched.connectors.drills import Drill, DrillStore
from kvsched.connectors.errors import StoreUnavailable
from kvsched.connectors.transfer import TransferEngine


def test_directory_store_keeps_the_first_writer_reads_missing_as_none_and_removes(
    tmp_path: Path,
):
    store = DirectoryStore(tmp_path / "s")
    store.put_many([("a/1", b"first"), ("b", b"x")])
    store.put_many([("a/1", b"second")])
    assert store.get_many(["a/1", "b", "c"]) == [b"first", b"x", None]
    assert store.batch_exists(["a/1", "c"]) == [True, False]
    store.remove(["a/1"])
    assert store.get_many(["a/1"]) == [None]
    with pytest.raises(ValueError, match="empty value"):
        store.put_many([("e", b"")])
    assert not list((tmp_path / "s").rglob("*.tmp"))  # (no temporary file left behind)


def test_directory_store_is_shared_with_another_process(tmp_path: Path):
    DirectoryStore(tmp_path / "s").put_many([("k", b"from here")])
    code = (
        "import sys; from kvsched.connectors.directory_store import DirectoryStore as D;"
        "s = D(sys.argv[1]); print(s.get_many(['k'])[0].decode()); s.put_many([('j', b'back')])"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path / "s")], capture_output=True, text=True
    )
    assert out.stdout.strip() == "from here", out.stderr
    assert DirectoryStore(tmp_path / "s").get_many(["j"]) == [b"back"]


def test_a_directory_store_whose_directory_is_gone_is_unavailable(tmp_path: Path):
    store = DirectoryStore(tmp_path / "s")
    (tmp_path / "s").rmdir()
    with pytest.raises(StoreUnavailable, match="missing"):
        store.get_many(["k"])


def _filled(tmp_path: Path, n: int) -> DirectoryStore:
    store = DirectoryStore(tmp_path / "s")
    store.put_many([(f"k{i}", bytes([i]) * 8) for i in range(n)])
    return store


def test_an_evict_drill_removes_each_key_read_after_its_cue(tmp_path: Path):
    inner = _filled(tmp_path, 4)
    drill = DrillStore(inner, Drill(mode="evict", after=2))
    assert drill.get_many(["k0", "k1", "k2", "k3"]) == [b"\0" * 8, b"\1" * 8, None, None]
    assert inner.batch_exists(["k0", "k2"]) == [True, False]


def test_a_kill_drill_raises_unavailable_with_the_values_read_before_it(tmp_path: Path):
    drill = DrillStore(_filled(tmp_path, 4), Drill(mode="kill", after=3))
    with pytest.raises(StoreUnavailable) as err:
        drill.get_many(["k0", "k1", "k2", "k3"])
    assert err.value.partial == (b"\0" * 8, b"\1" * 8, b"\2" * 8)
    with pytest.raises(StoreUnavailable):
        drill.batch_exists(["k0"])  # (killed: every later call fails)


def test_a_put_drill_counts_only_writes(tmp_path: Path):
    drill = DrillStore(_filled(tmp_path, 1), Drill(mode="kill", on="put", after=1))
    assert drill.get_many(["k0"]) == [b"\0" * 8]
    drill.put_many([("n0", b"ok")])
    with pytest.raises(StoreUnavailable):
        drill.put_many([("n1", b"lost")])


@pytest.mark.parametrize(
    "drill, good, why",
    [
        (Drill(mode="kill", after=3), 3, "killed"),
        (Drill(mode="evict", after=2), 2, "block 2 missing"),
        (Drill(mode="freeze", after=1, freeze_s=2.0), 0, "timed out"),
    ],
)
def test_a_load_under_a_drill_reports_only_the_blocks_written_before_the_fault(
    tmp_path: Path, drill: Drill, good: int, why: str
):
    engine = TransferEngine(
        DrillStore(_filled(tmp_path, 5), drill), HostBlockBuffer(8, 8), job_timeout_s=0.5
    )
    engine.start_load(7, [f"k{i}" for i in range(5)], [1, 2, 3, 4, 5])
    deadline = time.monotonic() + 5
    report = engine.poll()
    while not report.failed_loads and time.monotonic() < deadline:
        time.sleep(0.05)
        report = engine.poll()
    assert report.failed_loads[7][0] == good
    assert why in report.failed_loads[7][1]
    engine.close()
