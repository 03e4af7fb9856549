"""The policy-state boundary, checked on the source: the policy (``src/kvsched/policy``) never
writes to state except by emitting events, and no module reaches a private name of another.

A static scan (``ast``), so it holds for paths no test runs:

* **writes**: in a policy function, a name is *state* when it is a parameter named ``state``
  or annotated with an owner type (a class of ``kvsched.reducers``, e.g. ``Seq``,
  ``EngineState``), or is bound from an expression rooted in state (``t = state.seqs``,
  ``c = ckpts.get(i)``, ``for c in state.ckpts.evictable()``). A store to an attribute or
  an item rooted in state (``=``, ``+=``, ``del``), a call of a mutating method on it (a
  container's ``append``, ``pop``..., or an owner method that writes its own or its
  arguments' attributes, found by scanning the owners), or a numpy call writing into it
  (``np.add.at(x, ...)``, ``out=x``) is a violation.
* **private names**: ``x._name`` where ``x`` is not ``self``/``cls`` and ``_name`` is
  defined in no class or function of the same module, and ``from M import _name`` across
  modules, anywhere in ``src/kvsched``; the allowlist below names each exception and why.
* **raw reads**: a policy read of an owner's column (a numpy array, a container or a private
  field of ``state.seqs``, ``state.pool``...; the columns are read off a live
  ``EngineState``) instead of one of its queries (``RAW_READS_ALLOWED``, empty, would name
  the exceptions).
"""

from __future__ import annotations

import ast
from collections import deque
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from kvsched.config import ExternalStore, SchedulerConfig
from kvsched.reducers.state import EngineState

SRC = Path(__file__).resolve().parents[1] / "src" / "kvsched"
POLICY = sorted((SRC / "policy").glob("*.py"))
REDUCERS = sorted((SRC / "reducers").glob("*.py"))

CONTAINER_MUTATORS = frozenset(
    [
        "append",
        "appendleft",
        "extend",
        "insert",
        "pop",
        "popleft",
        "remove",
        "clear",
        "update",
        "setdefault",
        "add",
        "discard",
        "sort",
        "reverse",
        "fill",
        "put",
        "itemset",
        "resize",
        "setflags",
        "__setitem__",
        "__delitem__",
    ]
)
NUMPY_WRITERS = frozenset(["at", "copyto", "put", "place", "putmask", "fill_diagonal"])
# Builtins whose result holds the very objects of their argument (state objects stay state).
PASS_THROUGH = frozenset(
    ["sorted", "list", "tuple", "reversed", "iter", "next", "min", "max", "enumerate", "zip"]
)

# Owner queries that write only a memo of their own answers (a cache of a pure function:
# the same question always gets the same answer, and no fold or other query reads the memo).
# An entry is "method": reason.
WRITING_QUERIES: dict[str, str] = {
    "arrival": "memoises each (adapter, salt) namespace root it computes",
    "rows_of": "keeps its last few answers, keyed by the id array and the rows' version",
}

# Cross-module private names, "module:name" ("*:name": any module): reason.
PRIVATE_ALLOWED: dict[str, str] = {
    "bench/admit.py:_config": "bench admit runs bench match's workload: its set-up, shared",
    "bench/admit.py:_prefill_producers": "bench admit runs bench match's workload (set-up)",
    "*:_SubParsersAction": "argparse names no public type for add_subparsers' result "
    "(annotations only)",
    "identity.py:_kvs128": "the native kernel's extension module; identity.py is its wrapper",
    "gpu/fingerprint.py:_mix": "the fingerprint executor mixes tokens exactly as the "
    "simulator it checks against (one definition)",
    "replay/recovery.py:_ended": "recovery reads a run's end as the driver that wrote it",
}


def _root(node: ast.expr) -> ast.expr:
    """The innermost object of an attribute, item or method-call chain."""
    while True:
        if isinstance(node, (ast.Attribute, ast.Subscript, ast.Starred)):
            node = node.value
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            node = node.func.value
        else:
            return node


def _bound_names(target: ast.expr) -> Iterator[str]:
    """The names an assignment target binds (not those of an attribute or item it stores)."""
    if isinstance(target, ast.Name):
        yield target.id
    elif isinstance(target, (ast.Tuple, ast.List)):
        for t in target.elts:
            yield from _bound_names(t)
    elif isinstance(target, ast.Starred):
        yield from _bound_names(target.value)


def _names(node: ast.AST) -> Iterator[str]:
    for n in ast.walk(node):
        if isinstance(n, ast.Name):
            yield n.id


# ------------------------------------------------------------------- owner methods


def _writes_self_or_args(fn: ast.FunctionDef) -> bool:
    """Whether a method stores into, or mutates, ``self`` or one of its parameters."""
    params = {a.arg for a in fn.args.args + fn.args.kwonlyargs}
    for node in ast.walk(fn):
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        elif isinstance(node, ast.Delete):
            targets = node.targets
        for target in targets:
            for t in target.elts if isinstance(target, ast.Tuple) else [target]:
                if isinstance(t, (ast.Attribute, ast.Subscript)):
                    root = _root(t)
                    if isinstance(root, ast.Name) and root.id in params:
                        return True
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            root = _root(node.func.value)
            calls_mutator = node.func.attr in CONTAINER_MUTATORS
            if calls_mutator and isinstance(root, ast.Name) and root.id in params:
                return True
    return False


def owner_types_and_writers(modules: list[Path]) -> tuple[set[str], set[str]]:
    """The class names of the owners' modules, and their public methods that write (to
    ``self``, to an argument, or through another writing method of ``self``)."""
    types: set[str] = {"EngineState"}
    methods: dict[str, ast.FunctionDef] = {}
    for path in modules:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                types.add(node.name)
                for item in node.body:
                    if isinstance(item, ast.FunctionDef):
                        methods[f"{node.name}.{item.name}"] = item
    writers = {key for key, fn in methods.items() if _writes_self_or_args(fn)}
    changed = True
    while changed:  # a method calling a writing method of self writes too
        changed = False
        for key, fn in methods.items():
            if key in writers:
                continue
            cls = key.split(".")[0]
            for node in ast.walk(fn):
                if (
                    isinstance(node, ast.Call)
                    and isinstance(node.func, ast.Attribute)
                    and isinstance(node.func.value, ast.Name)
                    and node.func.value.id == "self"
                    and f"{cls}.{node.func.attr}" in writers
                ):
                    writers.add(key)
                    changed = True
                    break
    public = {k.split(".")[1] for k in writers if not k.split(".")[1].startswith("_")}
    return types, public - {"__init__"}


# ------------------------------------------------------------------ policy writes


class _PolicyWrites(ast.NodeVisitor):
    def __init__(self, where: str, owner_types: set[str], writers: set[str]) -> None:
        self.where = where
        self.owner_types = owner_types
        self.writers = writers
        self.found: list[str] = []

    def visit_FunctionDef(self, fn: ast.FunctionDef) -> None:
        tainted = {
            a.arg
            for a in fn.args.posonlyargs + fn.args.args + fn.args.kwonlyargs
            if a.arg == "state"
            or (a.annotation is not None and set(_names(a.annotation)) & self.owner_types)
        }
        for _ in range(4):  # bindings in any order: a few passes reach the fixpoint
            for node in ast.walk(fn):
                self._bind(node, tainted)
        for node in ast.walk(fn):
            self._check(node, tainted)

    visit_AsyncFunctionDef = visit_FunctionDef  # type: ignore[assignment]

    def _is_state(self, node: ast.expr | None, tainted: set[str]) -> bool:
        if node is None:
            return False
        if isinstance(node, ast.IfExp):
            return self._is_state(node.body, tainted) or self._is_state(node.orelse, tainted)
        if isinstance(node, ast.BoolOp):
            return any(self._is_state(v, tainted) for v in node.values)
        if isinstance(node, (ast.Tuple, ast.List)):
            return any(self._is_state(v, tainted) for v in node.elts)
        if isinstance(node, ast.NamedExpr):
            return self._is_state(node.value, tainted)
        call = isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
        if call and node.func.id in PASS_THROUGH:  # type: ignore[attr-defined]
            return any(self._is_state(a, tainted) for a in node.args)  # type: ignore[attr-defined]
        root = _root(node)
        return isinstance(root, ast.Name) and root.id in tainted

    def _bind(self, node: ast.AST, tainted: set[str]) -> None:
        pairs: list[tuple[ast.expr, ast.expr | None, bool]] = []
        if isinstance(node, ast.Assign):
            pairs = [(t, node.value, False) for t in node.targets]
        elif isinstance(node, (ast.AnnAssign, ast.NamedExpr)):
            pairs = [(node.target, node.value, False)]
        elif isinstance(node, (ast.For, ast.comprehension)):
            pairs = [(node.target, node.iter, True)]
        elif isinstance(node, ast.withitem) and node.optional_vars is not None:
            pairs = [(node.optional_vars, node.context_expr, False)]
        for target, value, iterated in pairs:
            # An iteration over anything that mentions state yields state objects.
            state = (
                bool(set(_names(value)) & tainted)
                if iterated and value is not None
                else self._is_state(value, tainted)
            )
            if state:
                tainted.update(_bound_names(target))

    def _report(self, node: ast.AST, what: str) -> None:
        self.found.append(f"{self.where}:{getattr(node, 'lineno', 0)}: {what}")

    def _check(self, node: ast.AST, tainted: set[str]) -> None:
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        elif isinstance(node, ast.Delete):
            targets = node.targets
        for target in targets:
            for t in ast.walk(target):
                if (
                    isinstance(t, (ast.Attribute, ast.Subscript))
                    and isinstance(t.ctx, (ast.Store, ast.Del))
                    and self._is_state(t.value, tainted)
                ):
                    self._report(node, f"writes state: {ast.unparse(t)}")
        if not isinstance(node, ast.Call):
            return
        func = node.func
        if isinstance(func, ast.Attribute) and self._is_state(func.value, tainted):
            name = func.attr
            if name in CONTAINER_MUTATORS or (name in self.writers and name not in WRITING_QUERIES):
                self._report(node, f"calls a mutating method on state: {ast.unparse(func)}")
        writer = isinstance(func, ast.Attribute) and func.attr in NUMPY_WRITERS
        if writer and node.args and self._is_state(node.args[0], tainted):
            self._report(node, f"numpy writes into state: {ast.unparse(node)}")
        for kw in node.keywords:
            if kw.arg == "out" and self._is_state(kw.value, tainted):
                self._report(node, f"numpy writes into state: {ast.unparse(node)}")


_OWNERS = owner_types_and_writers(REDUCERS)


def policy_writes(source: str, where: str = "<planted>") -> list[str]:
    visitor = _PolicyWrites(where, *_OWNERS)
    visitor.visit(ast.parse(source))
    return visitor.found


# ------------------------------------------------------------------- private names


def _defined_private(tree: ast.Module) -> set[str]:
    """Private names a module defines: functions, classes, class-level and ``self.``
    attributes, module-level bindings."""
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            out.add(node.attr)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            out.add(node.id)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            out.add(node.target.id)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            out.add(node.value)  # (__slots__ entries, attrs fields named by string)
    return {n for n in out if n.startswith("_")}


def _allowed(module: str, name: str) -> bool:
    return f"{module}:{name}" in PRIVATE_ALLOWED or f"*:{name}" in PRIVATE_ALLOWED


def private_reaches(source: str, module: str) -> list[str]:
    tree = ast.parse(source)
    own = _defined_private(tree)
    found: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_"):
            if node.attr.startswith("__") and node.attr.endswith("__"):
                continue
            base = node.value
            if isinstance(base, ast.Name) and base.id in ("self", "cls"):
                continue
            if node.attr not in own and not _allowed(module, node.attr):
                found.append(f"{module}:{node.lineno}: {ast.unparse(node)}")
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("kvsched"):
            for alias in node.names:
                private = alias.name.startswith("_") and not alias.name.startswith("__")
                if private and not _allowed(module, alias.name):
                    found.append(f"{module}:{node.lineno}: imports {node.module}.{alias.name}")
    return found


# ------------------------------------------------------------------------- tests


def test_the_owner_scan_finds_the_owners_and_their_writing_methods() -> None:
    types, writers = _OWNERS
    assert {"EngineState", "Seq", "BlockPool", "CheckpointTable", "Checkpoint"} <= types
    assert "apply" in writers  # BlockPool's reference changes
    assert not {"find", "get", "evictable", "cached_prefix", "free_top"} & writers


def test_the_policy_never_writes_to_state_except_by_emitting_events() -> None:
    found = [f for p in POLICY for f in policy_writes(p.read_text(), f"policy/{p.name}")]
    assert found == []


PLANTED = {
    "an attribute of an owner": "def f(self, state):\n    state.seqs.computed = 0\n",
    "an item of an owner's array": "def f(self, state, row):\n    t = state.seqs\n"
    "    t.computed[row] += 1\n",
    "a field of a state object": "def f(self, seq: Seq):\n    seq.priority = 3\n",
    "an object found through a query": "def f(self, state, i):\n    c = state.ckpts.get(i)\n"
    "    c.pins = 0\n",
    "an object met in a loop": "def f(self, state):\n    for c in state.ckpts.evictable():\n"
    "        c.hits += 1\n",
    "a deletion": "def f(self, state, h):\n    del state.pool.index[h]\n",
    "a container mutation": "def f(self, state):\n    state.ckpts.by_producer.clear()\n",
    "an owner's writing method": "def f(self, state, change):\n    state.pool.apply(change)\n",
    "a numpy write": "def f(self, state, rows):\n    np.add.at(state.pool.ref, rows, 1)\n",
    "a numpy out=": "def f(self, state, a):\n    np.add(a, 1, out=state.seqs.computed)\n",
}


@pytest.mark.parametrize("kind", sorted(PLANTED))
def test_a_planted_policy_write_to_state_is_caught(kind: str) -> None:
    assert len(policy_writes(PLANTED[kind])) == 1, kind


def test_reads_queries_emits_and_the_policys_own_fields_are_not_writes() -> None:
    source = (
        "def f(self, state, emit):\n"
        "    t = state.seqs\n"
        "    delta = np.zeros(state.pool.num_blocks)\n"
        "    np.add.at(delta, t.table[0], 1)\n"
        "    self.seen = t.computed[0]\n"
        "    spare = list(t.running_rows())\n"
        "    emit(ev.BlocksFreed(t.row_seq[spare], 1, delta))\n"
        "    seq = state.seq(0)\n"
        "    key = state.seqs.identity_at(seq, 16)\n"
    )
    assert policy_writes(source) == []


def test_no_module_reaches_a_private_name_of_another() -> None:
    found = []
    for path in sorted(SRC.rglob("*.py")):
        found += private_reaches(path.read_text(), str(path.relative_to(SRC)))
    assert found == []


def test_every_allowlist_entry_is_still_needed() -> None:
    """A stale entry would silently allow the next reach: each must match something."""
    hits: set[str] = set()
    saved = dict(PRIVATE_ALLOWED)
    try:
        for entry in saved:
            PRIVATE_ALLOWED.clear()
            PRIVATE_ALLOWED.update({k: v for k, v in saved.items() if k != entry})
            if any(
                private_reaches(p.read_text(), str(p.relative_to(SRC)))
                for p in sorted(SRC.rglob("*.py"))
            ):
                hits.add(entry)
    finally:
        PRIVATE_ALLOWED.clear()
        PRIVATE_ALLOWED.update(saved)
    assert set(saved) - hits == set()
    _, writers = _OWNERS
    stale = set(WRITING_QUERIES) - writers
    assert not stale, f"{sorted(stale)} no longer write: remove them from WRITING_QUERIES"


def test_a_planted_private_reach_is_caught() -> None:
    assert private_reaches("def f(state):\n    state.seqs._release_row(1)\n", "policy/x.py")
    assert private_reaches("from kvsched.reducers.blocks import _Path\n", "policy/x.py")
    assert not private_reaches("class A:\n    def f(self):\n        return self._x\n", "a.py")
    own = "def _g():\n    pass\ndef f(m):\n    return m._g\n"
    assert not private_reaches(own, "a.py")  # a name of the same module


# ------------------------------------------------------------ raw owner-column reads
#
# The owners' layout is private to them: the policy asks their queries (``seq_at(row)``,
# ``computed_at(row)``, ``rows_needing_blocks(rows)``, ``pool.cached_block(h)``...) instead
# of reading their columns. A *raw read* is ``X.a`` where ``X`` is an owner (``state.seqs``,
# ``state.pool``..., a name bound to one, or a parameter annotated with an owner's class) and
# ``a`` is one of its data attributes holding a numpy array or a container (list, dict, set,
# deque), or a private-by-convention one (``_a``). Scalars (``pool.num_blocks``,
# ``ckpts.next_id``) and properties are not columns.

# "policy/module.py:owner.attr": reason.
RAW_READS_ALLOWED: dict[str, str] = {}

_COLUMN_TYPES = (np.ndarray, list, dict, set, deque)


def _owner_columns() -> tuple[dict[str, str], dict[str, set[str]]]:
    """({class name: owner attribute of EngineState} for each owner class and its bases,
    {owner attribute: its raw columns}), read off a hybrid, external-KV engine's state."""
    state = EngineState(
        SchedulerConfig(
            num_blocks=64,
            max_batch=4,
            block_size=16,
            hybrid=True,
            external=ExternalStore(enabled=True),
        )
    )
    classes: dict[str, str] = {}
    columns: dict[str, set[str]] = {"state": set()}
    owners = {name: v for name, v in vars(state).items() if hasattr(v, "folds")}
    for name, owner in [("state", state), *owners.items()]:
        columns.setdefault(name, set())
        for cls in type(owner).__mro__[:-1]:
            classes.setdefault(cls.__name__, name)
        for attr in dir(owner):
            if attr.startswith("__") or isinstance(getattr(type(owner), attr, None), property):
                continue
            value = getattr(owner, attr, None)
            private = attr.startswith("_") and not callable(value)
            if private or isinstance(value, _COLUMN_TYPES):
                columns[name].add(attr)
    for name in owners:
        columns["state"].discard(name)
    return classes, columns


_CLASSES, _COLUMNS = _owner_columns()


def raw_reads(source: str, where: str = "<planted>") -> list[str]:
    """Each raw owner-column read in ``source``: "where:line: owner.attr (source text)"."""
    found: dict[tuple[int, int], str] = {}
    for fn in ast.walk(ast.parse(source)):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for node, owner in _owner_reads(fn):
                key = f"{owner}.{node.attr}"
                if node.attr in _COLUMNS[owner] and f"{where}:{key}" not in RAW_READS_ALLOWED:
                    found[(node.lineno, node.col_offset)] = (
                        f"{where}:{node.lineno}: {key} ({ast.unparse(node)})"
                    )
    return [found[k] for k in sorted(found)]


def _owner_reads(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> Iterator[tuple[ast.Attribute, str]]:
    """Attribute reads of an owner in ``fn``, with the owner's name."""
    bound: dict[str, str] = {}
    for a in fn.args.posonlyargs + fn.args.args + fn.args.kwonlyargs:
        if a.arg == "state":
            bound[a.arg] = "state"
        elif a.annotation is not None:
            for name in _names(a.annotation):
                if name in _CLASSES:
                    bound[a.arg] = _CLASSES[name]

    def owner(e: ast.expr) -> str | None:
        if isinstance(e, ast.Name):
            return bound.get(e.id)
        if isinstance(e, ast.Attribute) and owner(e.value) == "state" and e.attr in _COLUMNS:
            return e.attr
        return None

    for _ in range(3):  # bindings in any order: a few passes reach the fixpoint
        for node in ast.walk(fn):
            pairs: list[tuple[ast.expr, ast.expr]] = []
            if isinstance(node, ast.Assign):
                pairs = [(t, node.value) for t in node.targets]
            elif isinstance(node, (ast.AnnAssign, ast.NamedExpr)) and node.value is not None:
                pairs = [(node.target, node.value)]
            for target, value in pairs:
                if isinstance(target, ast.Tuple) and isinstance(value, ast.Tuple):
                    pairs += list(zip(target.elts, value.elts, strict=False))
                elif isinstance(target, ast.Name) and (o := owner(value)) is not None:
                    bound[target.id] = o
    for node in ast.walk(fn):
        if isinstance(node, ast.Attribute) and (o := owner(node.value)) is not None:
            yield node, o


def test_the_column_scan_knows_the_owners_columns() -> None:
    assert {"computed", "ntokens", "table", "row_seq", "objs", "waiting"} <= _COLUMNS["seqs"]
    assert {"ref", "index", "experts"} <= _COLUMNS["pool"]
    assert {"_saves", "by_producer", "saves_by_kind"} <= _COLUMNS["ckpts"]
    assert _CLASSES["RowTable"] == _CLASSES["SequenceTable"] == "seqs"
    scalars_and_queries = {"num_blocks", "num_available", "num_running", "computed_at"}
    assert not scalars_and_queries & (_COLUMNS["pool"] | _COLUMNS["seqs"])


def test_the_policy_reads_no_raw_owner_column() -> None:
    found = [f for p in POLICY for f in raw_reads(p.read_text(), f"policy/{p.name}")]
    assert found == [], "ask the owner a query instead:\n" + "\n".join(found)


def test_every_raw_read_allowlist_entry_is_still_needed() -> None:
    saved = dict(RAW_READS_ALLOWED)
    try:
        RAW_READS_ALLOWED.clear()
        found = [f for p in POLICY for f in raw_reads(p.read_text(), f"policy/{p.name}")]
    finally:
        RAW_READS_ALLOWED.update(saved)
    hits = {f"{f.split(':')[0]}:{f.split(': ')[1].split(' ')[0]}" for f in found}
    assert set(saved) - hits == set(), "stale entries: remove them from RAW_READS_ALLOWED"


PLANTED_READS = {
    "a column through a bound owner": "def f(self, state, rows):\n    t = state.seqs\n"
    "    return t.computed[rows]\n",
    "a column of state's owner": "def f(self, state, b):\n    return state.pool.ref[b] == 0\n",
    "a column of an annotated owner": "def f(t: SequenceTable, row: int):\n"
    "    return t.table[row]\n",
    "a container": "def f(self, state):\n    ckpts = state.ckpts\n"
    "    return list(ckpts.by_producer)\n",
    "a tuple binding": "def f(self, state, rows):\n    t, bs = state.seqs, 16\n"
    "    return t.ntokens[rows] // bs\n",
    "a private field": "def f(self, state):\n    return state.seqs._pending_rows\n",
    "a dict of records": "def f(self, state, i):\n    return state.seqs.seqs.get(i)\n",
}


@pytest.mark.parametrize("kind", sorted(PLANTED_READS))
def test_a_planted_raw_owner_column_read_is_caught(kind: str) -> None:
    assert len(raw_reads(PLANTED_READS[kind])) == 1, kind


def test_queries_scalars_and_records_are_not_raw_reads() -> None:
    source = (
        "def f(self, state, rows, emit):\n"
        "    t = state.seqs\n"
        "    seq = t.seq_at(int(rows[0]))\n"
        "    n = t.computed_at(seq.row) + t.num_running + state.pool.num_available\n"
        "    left = t.tokens_left(rows)\n"
        "    ok = state.hybrid and state.ckpts.next_id > 0\n"
        "    return seq.tokens[:n], left, ok, state.transfers.ready_loads()\n"
    )
    assert raw_reads(source) == []
