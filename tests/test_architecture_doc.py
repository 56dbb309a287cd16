"""docs/architecture.md names every module of obd's packages, and nothing that is not there."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PACKAGES = ("daemon", "executors", "trainer_plugin", "runner", "workloads")
DOC = REPO / "docs" / "architecture.md"


def _modules() -> set[str]:
    """Every module file (`package/sub/name.py`) of obd's packages, but the `__init__`s."""
    found = set()
    for package in PACKAGES:
        for path in (REPO / package).rglob("*.py"):
            if path.name != "__init__.py" and "__pycache__" not in path.parts:
                found.add(path.relative_to(REPO).as_posix())
    return found


def _named(text: str) -> set[str]:
    """The modules the document names, in full: a `name.py` under the heading of its package
    (`### daemon/cli/ — ...` names `daemon/cli/`), or a path with its folders."""
    named: set[str] = set()
    package = ""
    for line in text.splitlines():
        if line.startswith("#"):
            heading = re.match(r"^### (\S+/)", line)
            package = heading.group(1) if heading else ""  # a section of the document, not of a package
            continue
        for name in re.findall(r"`([\w/.]+\.py)`", line):
            if (REPO / name.split("/")[0]).is_dir() and "/" in name:
                named.add(name)  # a path from the repository's root
            elif package:
                named.add(package + name)
    return named


def test_the_architecture_document_names_every_module_and_only_those() -> None:
    modules, named = _modules(), _named(DOC.read_text())
    assert sorted(modules - named) == [], "modules the document does not name"
    phantoms = {n for n in named - modules if not (REPO / n).exists()}
    assert sorted(phantoms) == [], "names in the document with no module"
