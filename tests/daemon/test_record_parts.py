"""The record's parts are written only by their owners (issue 35, item 3).

`PART_OWNERS` (daemon/service/models.py) names, for each part of a `RunRecord`, the modules that
write it. This scans every module of daemon/ with `ast` for a write to a part: one of its fields
assigned (`x.preemption.preemptions = ...`, `+=`, `del`), changed in place by a method
(`x.retention.pruned.append(...)`), the part replaced (`x.retention = ...`), or given to a new
`RunRecord(preemption=...)`; any outside its owners fails, naming the line. A write through a
name a function bound to a part or to something in it (`p = x.preemption; p.lost_steps = 1`,
`pruned = x.retention.pruned; pruned.append(...)`) counts as well (daemon/service/move.py, stop.py,
limits.py and trackers.py write so); one through a name bound otherwise (a parameter given a part, `getattr`)
is not seen. Writes rooted at `self` are left out: no module but models.py has a record as `self`
(daemon/cli/ui/server.py's `self.limits` is the web view's own).
"""

from __future__ import annotations

import ast
import typing
from pathlib import Path

import pytest
from pydantic import BaseModel

from daemon.service import models
from daemon.service.models import FLAT_FIELDS, PART_OWNERS

REPO = Path(__file__).resolve().parents[2]
MUTATORS = {"append", "extend", "insert", "remove", "pop", "clear", "update", "setdefault", "add", "discard", "sort"}
# Each part's class, from the record's field (`Move | None` -> Move); target_info is a dict: its
# writes are checked, no docstring.
PART_CLASSES: dict[str, type[BaseModel]] = {
    part: cls
    for part in PART_OWNERS
    for annotation in [models.RunRecord.model_fields[part].annotation]
    for cls in typing.get_args(annotation) or (annotation,)
    if isinstance(cls, type) and issubclass(cls, BaseModel)
}


def _part_in(node: ast.expr) -> str | None:
    """The part an attribute chain goes through (`a.preemption.paused.since` -> preemption), unless
    it starts at `self`."""
    found = None
    while isinstance(node, ast.Attribute | ast.Subscript):
        if isinstance(node, ast.Attribute) and node.attr in PART_OWNERS:
            found = node.attr
        node = node.value
    if isinstance(node, ast.Name) and node.id == "self":
        return None
    return found


def _targets(node: ast.AST) -> list[ast.expr]:
    if isinstance(node, ast.Assign):
        out: list[ast.expr] = []
        for t in node.targets:
            out.extend(t.elts if isinstance(t, ast.Tuple | ast.List) else [t])
        return out
    if isinstance(node, ast.AugAssign | ast.AnnAssign):
        return [node.target]
    if isinstance(node, ast.Delete):
        return list(node.targets)
    return []


def _aliases(scope: ast.AST) -> dict[str, str]:
    """The names a function binds to a part or to something inside one (`st = record.stop`,
    `pruned = r.retention.pruned`), each with its part."""
    out = {}
    for node in ast.walk(scope):
        if isinstance(node, ast.Assign | ast.AnnAssign) and node.value is not None:
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            part = _part_in(node.value)
            if part is not None:
                out.update((t.id, part) for t in targets if isinstance(t, ast.Name))
    return out


def _alias_of(node: ast.expr, aliases: dict[str, str]) -> str | None:
    """The part an attribute chain goes through when it starts at an alias (`st.proof_at` -> stop)."""
    while isinstance(node, ast.Attribute | ast.Subscript):
        node = node.value
    return aliases.get(node.id) if isinstance(node, ast.Name) else None


def _writes_at(node: ast.AST, aliases: dict[str, str]) -> list[tuple[int, str]]:
    writes = []
    for target in _targets(node):
        part = _part_in(target)
        if part is None and isinstance(target, ast.Attribute | ast.Subscript):  # a bare name is rebound
            part = _alias_of(target, aliases)
        if part is not None:
            writes.append((target.lineno, part))
    if isinstance(node, ast.Call):
        func = node.func
        if isinstance(func, ast.Attribute) and func.attr in MUTATORS:
            part = _part_in(func.value) or _alias_of(func.value, aliases)
            if part is not None:
                writes.append((node.lineno, part))
        if isinstance(func, ast.Name) and func.id == "RunRecord":
            writes.extend((node.lineno, kw.arg) for kw in node.keywords if kw.arg in PART_OWNERS)
    return writes


def part_writes(source: str) -> list[tuple[int, str]]:
    """Each write to a part in `source`: (line, part)."""
    writes = []

    def visit(node: ast.AST, aliases: dict[str, str]) -> None:
        writes.extend(_writes_at(node, aliases))
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            aliases = {**aliases, **_aliases(node)}  # a closure sees its function's
        for child in ast.iter_child_nodes(node):
            visit(child, aliases)

    visit(ast.parse(source), {})  # at a module's top no name is a part's
    return sorted(writes)


def all_writes() -> dict[str, list[tuple[int, str]]]:
    out = {}
    for path in sorted((REPO / "daemon").rglob("*.py")):
        rel = path.relative_to(REPO).as_posix()
        if rel == "daemon/service/models.py":  # the parts themselves
            continue
        out[rel] = part_writes(path.read_text())
    return out


def test_the_scan_sees_every_kind_of_write() -> None:
    source = """
r.preemption.preemptions = 1
r.preemption.paused_seconds += 2.0
a, r.retention.pruned_bytes = 1, 2
r.retention.pruned.append("checkpoint-1")
r.dependencies = DependenciesPart()
x.record.limits.reached = None
del r.target_info["pod_id"]
r.target_info.update(pod_id="p")
RunRecord(id="r", preemption=PreemptionPart())
self.limits = Limits()
print(r.preemption.preemptions, r.retention.pruned.count("x"))

def f(r):
    st = r.stop
    pruned = r.retention.pruned
    print(st.reason)
    st.reason = "asked"
    pruned.append("checkpoint-2")
    st = None

    def inner():
        st.fallback = "late"

def g(st):
    st.reason = "not seen: st is g's own"
    pruned = []
    pruned.append(1)
"""
    assert part_writes(source) == [
        (2, "preemption"),
        (3, "preemption"),
        (4, "retention"),
        (5, "retention"),
        (6, "dependencies"),
        (7, "limits"),
        (8, "target_info"),
        (9, "target_info"),
        (10, "preemption"),
        (18, "stop"),
        (19, "retention"),
        (23, "stop"),
    ]


def test_a_part_is_written_only_by_its_owners() -> None:
    strays = [
        f"{path}:{line}: writes the record's `{part}`, owned by {', '.join(PART_OWNERS[part])} (models.PART_OWNERS)"
        for path, writes in all_writes().items()
        for line, part in writes
        if path not in PART_OWNERS[part]
    ]
    assert strays == []


def test_every_owner_writes_its_part() -> None:
    """The registry says who writes, not who once did: an owner that no longer writes is left out."""
    writes = all_writes()
    idle = [
        f"{owner} owns `{part}` but never writes it"
        for part, owners in PART_OWNERS.items()
        for owner in owners
        if part not in {p for _, p in writes.get(owner, [])}
    ]
    assert idle == []


@pytest.mark.parametrize("part", sorted(PART_CLASSES))
def test_a_part_s_docstring_names_its_owners(part: str) -> None:
    doc = PART_CLASSES[part].__doc__ or ""
    text = " ".join(doc.split())
    assert [o for o in PART_OWNERS[part] if o not in text] == [], f"{PART_CLASSES[part].__name__}'s docstring"


def test_every_part_is_a_field_of_the_record() -> None:
    assert set(PART_OWNERS) <= set(models.RunRecord.model_fields)
    for part, model in FLAT_FIELDS.items():
        assert models.RunRecord.model_fields[part].annotation is model
