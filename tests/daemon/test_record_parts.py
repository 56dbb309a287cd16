"""The record's parts are written only by their owners (issue 35, item 3).

`PART_OWNERS` (daemon/service/models.py) names, for each part of a `RunRecord`, the modules that
write it. This scans every module of daemon/ with `ast` for a write to a part: one of its fields
assigned (`x.preemption.preemptions = ...`, `+=`, `del`), changed in place by a method
(`x.retention.pruned.append(...)`), the part replaced (`x.retention = ...`), or given to a new
`RunRecord(preemption=...)`; any outside its owners fails, naming the line. A write through an
alias (`p = x.preemption; p.lost_steps = 1`) is not seen: no module writes so, none should.
Writes rooted at `self` are left out: no module but models.py has a record as `self`
(daemon/cli/ui/server.py's `self.limits` is the web view's own).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from daemon.service import models
from daemon.service.models import FLAT_FIELDS, PART_OWNERS, Limits

REPO = Path(__file__).resolve().parents[2]
MUTATORS = {"append", "extend", "insert", "remove", "pop", "clear", "update", "setdefault", "add", "discard", "sort"}
PART_CLASSES = {**FLAT_FIELDS, "limits": Limits}  # target_info is a dict: its writes are checked, no docstring


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


def part_writes(source: str) -> list[tuple[int, str]]:
    """Each write to a part in `source`: (line, part)."""
    writes = []
    for node in ast.walk(ast.parse(source)):
        for target in _targets(node):
            part = _part_in(target)
            if part is not None:
                writes.append((target.lineno, part))
        if isinstance(node, ast.Call):
            func = node.func
            if isinstance(func, ast.Attribute) and func.attr in MUTATORS:
                part = _part_in(func.value)
                if part is not None:
                    writes.append((node.lineno, part))
            if isinstance(func, ast.Name) and func.id == "RunRecord":
                writes.extend((node.lineno, kw.arg) for kw in node.keywords if kw.arg in PART_OWNERS)
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
