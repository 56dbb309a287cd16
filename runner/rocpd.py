"""rocprofv3's rocpd output, the SQLite database ROCm 7 writes by default (`<host>/<pid>_results.db`).

Read with the standard library's sqlite3, read-only. The schema is the one rocprofiler-sdk
publishes (`source/share/rocprofiler-sdk-rocpd/`: `rocpd_tables.sql`, `rocpd_views.sql`,
`data_views.sql`): each table is created with a per-database suffix (`rocpd_kernel_dispatch_<uuid>`)
and reached through an unsuffixed view of the same name; a dispatch names its kernel
(`rocpd_info_kernel_symbol`) and its agent (`rocpd_info_agent`, GPU details in its `extdata` JSON),
and the `kernels` view joins them as `rocpd convert` reads them.

The dispatches are read from `rocpd_kernel_dispatch` with left joins (a dispatch whose event or
region row is missing still counts, where the `kernels` view's inner joins would drop it), and
from the `kernels` view when those tables are not there. They are folded into the same
`KernelTrace` as the CSV traces, so every number downstream is computed one way.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from contextlib import closing
from pathlib import Path

from runner.rocprof import GpuAgent, KernelTrace, _fold_rows

# The columns `_fold_rows` reads, by position in the rows below.
INDEX = {"name": 0, "agent": 1, "start": 2, "end": 3}

DISPATCHES = """
SELECT COALESCE(S.display_name, S.kernel_name, 'kernel ' || K.kernel_id),
       'Agent ' || COALESCE(A.logical_index, K.agent_id),
       K.start, K."end"
FROM rocpd_kernel_dispatch K
LEFT JOIN rocpd_info_kernel_symbol S ON S.id = K.kernel_id AND S.guid = K.guid
LEFT JOIN rocpd_info_agent A ON A.id = K.agent_id AND A.guid = K.guid
ORDER BY K.start
"""
KERNELS_VIEW = """
SELECT COALESCE(name, 'kernel ' || kernel_id), 'Agent ' || agent_log_index, start, "end"
FROM kernels ORDER BY start
"""
GPU_AGENTS = """
SELECT name, COALESCE(product_name, json_extract(extdata, '$.product_name')), model_name,
       json_extract(extdata, '$.cu_count'), json_extract(extdata, '$.max_engine_clk_fcompute'),
       json_extract(extdata, '$.gfx_target_version'),
       COALESCE(json_extract(extdata, '$.node_id'), absolute_index),
       COALESCE(json_extract(extdata, '$.logical_node_id'), logical_index)
FROM rocpd_info_agent WHERE type = 'GPU' ORDER BY absolute_index
"""
GPU_AGENTS_PLAIN = """
SELECT name, product_name, model_name, NULL, NULL, NULL, absolute_index, logical_index
FROM rocpd_info_agent WHERE type = 'GPU' ORDER BY absolute_index
"""


def _connect(path: Path) -> sqlite3.Connection:
    """The database, read-only: a profile fetched from a target is never written to."""
    connection = sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True)
    connection.text_factory = lambda raw: raw.decode("utf-8", errors="replace")
    return connection


def _names(connection: sqlite3.Connection) -> set[str]:
    return {row[0] for row in connection.execute("SELECT name FROM sqlite_master WHERE type IN ('table', 'view')")}


def _schema_version(connection: sqlite3.Connection, names: set[str]) -> str:
    if "rocpd_metadata" not in names:
        return "?"
    row = connection.execute("SELECT value FROM rocpd_metadata WHERE tag = 'schema_version'").fetchone()
    return str(row[0]) if row else "?"


def read_kernels(path: Path, trace: KernelTrace, label: str | None = None) -> None:
    """Fold the kernel dispatches of one rocpd database into `trace`; a bad file adds a warning, never raises."""
    label = label or path.name
    try:
        with closing(_connect(path)) as connection:
            names = _names(connection)
            if "rocpd_kernel_dispatch" in names:
                rows: Iterator[tuple] = connection.execute(DISPATCHES)
                source = "rocpd_kernel_dispatch"
            elif "kernels" in names:
                rows, source = connection.execute(KERNELS_VIEW), "kernels view"
            else:
                trace.warnings.append(f"{label}: no rocpd kernel dispatch table or kernels view; file skipped")
                return
            trace.files.append(label)
            trace.layouts.append(f"rocpd database (schema {_schema_version(connection, names)}, {source})")
            _fold_rows(rows, INDEX, trace)  # a NULL or text timestamp counts as a bad row, as in a CSV
    except sqlite3.Error as exc:
        trace.warnings.append(f"{label}: not a readable rocpd database ({exc}); file skipped")


def read_agents(path: Path, warnings: list[str], label: str | None = None) -> list[GpuAgent]:
    """The GPU agents of one rocpd database (`rocpd_info_agent`, type GPU); CPUs are left out."""
    label = label or path.name
    try:
        with closing(_connect(path)) as connection:
            if "rocpd_info_agent" not in _names(connection):
                return []
            try:
                rows = connection.execute(GPU_AGENTS).fetchall()
            except sqlite3.OperationalError:  # an SQLite without JSON functions, or an older agent table
                rows = connection.execute(GPU_AGENTS_PLAIN).fetchall()
    except sqlite3.Error as exc:
        warnings.append(f"{label}: GPU agents not readable ({exc})")
        return []
    return [_agent(row) for row in rows]


def _agent(row: tuple) -> GpuAgent:
    name, product, model, cu, clock, gfx, node, logical = row
    return GpuAgent(
        name=str(name or "").strip(),
        product=str(product or model or "").strip(),
        cu_count=_whole(cu),
        max_clock_mhz=float(clock) if isinstance(clock, (int, float)) and clock > 0 else None,
        gfx_target_version=_whole(gfx),
        node_id="" if node is None else str(node),
        logical_node_id="" if logical is None else str(logical),
        source="rocpd database (rocpd_info_agent)",
    )


def _whole(value: object) -> int | None:
    return int(value) if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0 else None
