"""rocprofv3's rocpd SQLite output, ROCm 7's default (`<host>/<pid>_results.db`), is read (issue 34, item 21).

No real `.db` sample is published (the documentation has CSVs only), so each test builds a small
database here with the schema rocprofiler-sdk publishes (schema 3,
`source/share/rocprofiler-sdk-rocpd/`): the tables as `rocpd_tables.sql` creates them, with their
per-database suffix, the unsuffixed views of `rocpd_views.sql`, and the `kernels` view of
`data_views.sql`, with the tables the kernel dispatches need (string, node, process, thread,
agent, queue, stream, code object, kernel symbol, event). Its dispatches are the rows of the
documentation's real 2025 `kernel_trace.csv`, so the database must give the numbers that CSV gives.
"""

from __future__ import annotations

import csv
import json
import shutil
import sqlite3
from contextlib import closing
from pathlib import Path

import pytest

from runner import rocpd, rocprof
from runner.assemble import parse_run

SAMPLE = Path(__file__).resolve().parent / "fixtures" / "rocprofv3_docs" / "rocm-systems-2025" / "kernel_trace.csv"
UUID = "_0000ddb5_8903_7903_b269_cd8d3745bb8a"
GUID = "0000ddb5-8903-7903-b269-cd8d3745bb8a"

# Schema 3 of rocprofiler-sdk's rocpd, the tables a kernel dispatch touches ({u}: the suffix).
TABLES = """
CREATE TABLE rocpd_metadata{u} (id INTEGER NOT NULL PRIMARY KEY AUTOINCREMENT, tag TEXT NOT NULL, value TEXT NOT NULL);
CREATE TABLE rocpd_string{u} (id INTEGER NOT NULL PRIMARY KEY AUTOINCREMENT, guid TEXT DEFAULT "{g}" NOT NULL,
    string TEXT NOT NULL UNIQUE ON CONFLICT ABORT);
CREATE TABLE rocpd_info_node{u} (id INTEGER NOT NULL PRIMARY KEY AUTOINCREMENT, guid TEXT DEFAULT "{g}" NOT NULL,
    hash BIGINT NOT NULL UNIQUE, machine_id TEXT NOT NULL UNIQUE, system_name TEXT, hostname TEXT, release TEXT,
    version TEXT, hardware_name TEXT, domain_name TEXT);
CREATE TABLE rocpd_info_process{u} (id INTEGER NOT NULL PRIMARY KEY AUTOINCREMENT, guid TEXT DEFAULT "{g}" NOT NULL,
    nid INTEGER NOT NULL, ppid INTEGER, pid INTEGER NOT NULL, init BIGINT, fini BIGINT, start BIGINT, "end" BIGINT,
    command TEXT, environment JSONB DEFAULT "{{}}" NOT NULL, extdata JSONB DEFAULT "{{}}" NOT NULL);
CREATE TABLE rocpd_info_thread{u} (id INTEGER NOT NULL PRIMARY KEY AUTOINCREMENT, guid TEXT DEFAULT "{g}" NOT NULL,
    nid INTEGER NOT NULL, ppid INTEGER, pid INTEGER NOT NULL, tid INTEGER NOT NULL, name TEXT, start BIGINT,
    "end" BIGINT, extdata JSONB DEFAULT "{{}}" NOT NULL);
CREATE TABLE rocpd_info_agent{u} (id INTEGER NOT NULL PRIMARY KEY AUTOINCREMENT, guid TEXT DEFAULT "{g}" NOT NULL,
    nid INTEGER NOT NULL, pid INTEGER NOT NULL, type TEXT CHECK (type IN ('CPU', 'GPU')), absolute_index INTEGER,
    logical_index INTEGER, type_index INTEGER, uuid INTEGER, name TEXT, model_name TEXT, vendor_name TEXT,
    product_name TEXT, user_name TEXT, extdata JSONB DEFAULT "{{}}" NOT NULL);
CREATE TABLE rocpd_info_queue{u} (id INTEGER NOT NULL PRIMARY KEY AUTOINCREMENT, guid TEXT DEFAULT "{g}" NOT NULL,
    nid INTEGER NOT NULL, pid INTEGER NOT NULL, name TEXT, extdata JSONB DEFAULT "{{}}" NOT NULL);
CREATE TABLE rocpd_info_stream{u} (id INTEGER NOT NULL PRIMARY KEY AUTOINCREMENT, guid TEXT DEFAULT "{g}" NOT NULL,
    nid INTEGER NOT NULL, pid INTEGER NOT NULL, name TEXT, extdata JSONB DEFAULT "{{}}" NOT NULL);
CREATE TABLE rocpd_info_code_object{u} (id INTEGER NOT NULL PRIMARY KEY AUTOINCREMENT,
    guid TEXT DEFAULT "{g}" NOT NULL, nid INTEGER NOT NULL, pid INTEGER NOT NULL, agent_id INTEGER, uri TEXT,
    load_base BIGINT, load_size BIGINT, load_delta BIGINT, storage_type TEXT CHECK (storage_type IN ('FILE', 'MEMORY')),
    extdata JSONB DEFAULT "{{}}" NOT NULL);
CREATE TABLE rocpd_info_kernel_symbol{u} (id INTEGER NOT NULL PRIMARY KEY AUTOINCREMENT,
    guid TEXT DEFAULT "{g}" NOT NULL, nid INTEGER NOT NULL, pid INTEGER NOT NULL, code_object_id INTEGER NOT NULL,
    kernel_name TEXT, display_name TEXT, kernel_object INTEGER, kernarg_segment_size INTEGER,
    kernarg_segment_alignment INTEGER, group_segment_size INTEGER, private_segment_size INTEGER, sgpr_count INTEGER,
    arch_vgpr_count INTEGER, accum_vgpr_count INTEGER, extdata JSONB DEFAULT "{{}}" NOT NULL);
CREATE TABLE rocpd_event{u} (id INTEGER NOT NULL PRIMARY KEY AUTOINCREMENT, guid TEXT DEFAULT "{g}" NOT NULL,
    category_id INTEGER, stack_id INTEGER, parent_stack_id INTEGER, correlation_id INTEGER,
    call_stack JSONB DEFAULT "{{}}" NOT NULL, line_info JSONB DEFAULT "{{}}" NOT NULL,
    extdata JSONB DEFAULT "{{}}" NOT NULL);
CREATE TABLE rocpd_kernel_dispatch{u} (id INTEGER NOT NULL PRIMARY KEY AUTOINCREMENT,
    guid TEXT DEFAULT "{g}" NOT NULL, nid INTEGER NOT NULL, pid INTEGER NOT NULL, tid INTEGER,
    agent_id INTEGER NOT NULL, kernel_id INTEGER NOT NULL, dispatch_id INTEGER NOT NULL, queue_id INTEGER NOT NULL,
    stream_id INTEGER NOT NULL, start BIGINT NOT NULL, "end" BIGINT NOT NULL, private_segment_size INTEGER,
    group_segment_size INTEGER, workgroup_size_x INTEGER NOT NULL, workgroup_size_y INTEGER NOT NULL,
    workgroup_size_z INTEGER NOT NULL, grid_size_x INTEGER NOT NULL, grid_size_y INTEGER NOT NULL,
    grid_size_z INTEGER NOT NULL, region_name_id INTEGER, event_id INTEGER, extdata JSONB DEFAULT "{{}}" NOT NULL);
"""
SUFFIXED = [
    "rocpd_metadata",
    "rocpd_string",
    "rocpd_info_node",
    "rocpd_info_process",
    "rocpd_info_thread",
    "rocpd_info_agent",
    "rocpd_info_queue",
    "rocpd_info_stream",
    "rocpd_info_code_object",
    "rocpd_info_kernel_symbol",
    "rocpd_event",
    "rocpd_kernel_dispatch",
]
# data_views.sql's `kernels` (the columns obd or `rocpd convert` read, with the view's joins).
KERNELS_VIEW = """
CREATE VIEW kernels AS SELECT K.id, K.guid, T.tid,
    (SELECT string FROM rocpd_string RS WHERE RS.id = E.category_id AND RS.guid = E.guid) AS category,
    R.string AS region, S.display_name AS name, K.nid, P.pid, A.absolute_index AS agent_abs_index,
    A.logical_index AS agent_log_index, A.type_index AS agent_type_index, A.type AS agent_type,
    S.code_object_id AS code_object_id, K.kernel_id, K.dispatch_id, K.stream_id, K.queue_id, Q.name AS queue,
    ST.name AS stream, K.start, K."end", (K."end" - K.start) AS duration, E.correlation_id AS corr_id
FROM rocpd_kernel_dispatch K
    INNER JOIN rocpd_info_agent A ON A.id = K.agent_id AND A.guid = K.guid
    INNER JOIN rocpd_event E ON E.id = K.event_id AND E.guid = K.guid
    INNER JOIN rocpd_string R ON R.id = K.region_name_id AND R.guid = K.guid
    INNER JOIN rocpd_info_kernel_symbol S ON S.id = K.kernel_id AND S.guid = K.guid
    LEFT JOIN rocpd_info_stream ST ON ST.id = K.stream_id AND ST.guid = K.guid
    LEFT JOIN rocpd_info_queue Q ON Q.id = K.queue_id AND Q.guid = K.guid
    INNER JOIN rocpd_info_process P ON P.id = Q.pid AND P.guid = Q.guid
    INNER JOIN rocpd_info_thread T ON T.id = K.tid AND T.guid = K.guid;
"""
MI300X = {
    "cu_count": 304,
    "max_engine_clk_fcompute": 2100,
    "gfx_target_version": 90402,
    "node_id": 2,
    "logical_node_id": 1,
    "product_name": "AMD Instinct MI300X",
}


def sample_rows() -> list[dict[str, str]]:
    with SAMPLE.open(newline="") as stream:
        return list(csv.DictReader(stream))


def build_database(path: Path, without_event: int = 0) -> None:
    """A rocpd database of the sample trace's dispatches on one MI300X; `without_event` dispatches lack their event row."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with closing(sqlite3.connect(path)) as db, db:
        db.executescript(TABLES.format(u=UUID, g=GUID))
        db.executescript("".join(f"CREATE VIEW {name} AS SELECT * FROM {name}{UUID};\n" for name in SUFFIXED))
        db.executescript(KERNELS_VIEW)
        db.execute(
            f"INSERT INTO rocpd_metadata{UUID} (tag, value) VALUES ('schema_version', '3'), ('guid', ?)", (GUID,)
        )
        db.execute(f"INSERT INTO rocpd_info_node{UUID} (id, hash, machine_id, hostname) VALUES (1, 7, 'm', 'gpuhost')")
        db.execute(f"INSERT INTO rocpd_info_process{UUID} (id, nid, pid) VALUES (1, 1, 834304)")
        db.execute(f"INSERT INTO rocpd_info_thread{UUID} (id, nid, pid, tid) VALUES (1, 1, 1, 834304)")
        db.execute(
            f"INSERT INTO rocpd_info_agent{UUID} (id, nid, pid, type, absolute_index, logical_index, type_index, name,"
            " product_name) VALUES (1, 1, 1, 'CPU', 0, 0, 0, 'AMD EPYC 9474F', 'AMD EPYC 9474F 48-Core Processor')"
        )
        db.execute(
            f"INSERT INTO rocpd_info_agent{UUID} (id, nid, pid, type, absolute_index, logical_index, type_index, name,"
            " model_name, product_name, extdata) VALUES (2, 1, 1, 'GPU', 2, 4, 0, 'gfx942', 'aqua_vanjaram',"
            " 'AMD Instinct MI300X', ?)",
            (json.dumps(MI300X),),
        )
        db.execute(f"INSERT INTO rocpd_info_queue{UUID} (id, nid, pid, name) VALUES (1, 1, 1, 'queue 1')")
        db.execute(f"INSERT INTO rocpd_info_stream{UUID} (id, nid, pid, name) VALUES (1, 1, 1, 'stream 1')")
        db.execute(f"INSERT INTO rocpd_info_code_object{UUID} (id, nid, pid, agent_id) VALUES (1, 1, 1, 2)")
        db.execute(f"INSERT INTO rocpd_string{UUID} (id, string) VALUES (1, 'KERNEL_DISPATCH'), (2, 'region')")
        symbols: dict[str, int] = {}
        for i, row in enumerate(sample_rows(), start=1):
            name = row["Kernel_Name"]
            if name not in symbols:
                symbols[name] = len(symbols) + 1
                db.execute(
                    f"INSERT INTO rocpd_info_kernel_symbol{UUID} (id, nid, pid, code_object_id, kernel_name,"
                    " display_name) VALUES (?, 1, 1, 1, ?, ?)",
                    (symbols[name], f"_Z{len(name)}mangled", name),
                )
            event = None if i <= without_event else i
            if event is not None:
                db.execute(f"INSERT INTO rocpd_event{UUID} (id, category_id, correlation_id) VALUES (?, 1, ?)", (i, i))
            db.execute(
                f"INSERT INTO rocpd_kernel_dispatch{UUID} (nid, pid, tid, agent_id, kernel_id, dispatch_id, queue_id,"
                ' stream_id, start, "end", workgroup_size_x, workgroup_size_y, workgroup_size_z, grid_size_x,'
                " grid_size_y, grid_size_z, region_name_id, event_id) VALUES (1, 1, 1, 2, ?, ?, 1, 1, ?, ?, 64, 1, 1,"
                " 1024, 1024, 1, 2, ?)",
                (symbols[name], int(row["Dispatch_Id"]), int(row["Start_Timestamp"]), int(row["End_Timestamp"]), event),
            )


@pytest.fixture
def csv_profile(tmp_path: Path) -> Path:
    """The same dispatches as rocprofv3's CSV output, for comparison."""
    profile = tmp_path / "csv" / "gpuhost"
    profile.mkdir(parents=True)
    shutil.copy(SAMPLE, profile / "834304_kernel_trace.csv")
    return tmp_path / "csv"


def test_a_rocpd_database_gives_the_numbers_of_the_csv_trace_of_the_same_dispatches(tmp_path, csv_profile):
    build_database(tmp_path / "db" / "gpuhost" / "834304_results.db")
    from_db, from_csv = parse_run(tmp_path / "db"), parse_run(csv_profile)
    assert from_db.profiler == "rocprofv3" and from_db.device_kind == "amd"
    assert from_db.dispatch_count == len(sample_rows()) == from_csv.dispatch_count
    assert from_db.top_kernels == from_csv.top_kernels
    assert from_db.kernel_time_s == from_csv.kernel_time_s and from_db.gpu_busy_s == from_csv.gpu_busy_s
    assert from_db.gpu_count == 1 and from_db.files == ["gpuhost/834304_results.db"]
    assert "rocpd database file(s)" in from_db.sources["top_kernels"]
    assert "layout: rocpd database (schema 3, rocpd_kernel_dispatch)" in from_db.sources["top_kernels"]
    assert not [w for w in from_db.warnings if "rocpd" in w or "unreadable" in w], from_db.warnings


def test_the_gpu_and_its_peak_come_from_the_databases_agent_table(tmp_path):
    build_database(tmp_path / "gpuhost" / "834304_results.db")
    metrics = parse_run(tmp_path)
    assert metrics.gpu_name == "AMD Instinct MI300X"
    assert metrics.sources["gpu_name"] == "rocpd database (rocpd_info_agent) (1 GPU(s) on the node)"
    assert metrics.peak_tflops == pytest.approx(304 * 2100e6 * 2048 / 1e12)
    assert metrics.sources["peak_tflops"].startswith("rocpd database (rocpd_info_agent): 304 CUs x 2100 MHz")


def test_a_dispatch_whose_event_row_is_missing_still_counts_where_the_kernels_view_would_drop_it(tmp_path):
    path = tmp_path / "gpuhost" / "834304_results.db"
    build_database(path, without_event=2)
    with closing(sqlite3.connect(path)) as db:
        assert db.execute("SELECT COUNT(*) FROM kernels").fetchone()[0] == len(sample_rows()) - 2
    trace = rocprof.KernelTrace()
    rocpd.read_kernels(path, trace)
    trace.finish()
    assert trace.dispatches == len(sample_rows())


def test_a_database_with_only_the_kernels_view_is_read_through_it(tmp_path):
    path = tmp_path / "1_results.db"
    with closing(sqlite3.connect(path)) as db, db:
        db.execute(
            'CREATE TABLE kernels (name TEXT, kernel_id INTEGER, agent_log_index INTEGER, start INTEGER, "end" INTEGER)'
        )
        db.executemany(
            "INSERT INTO kernels VALUES (?, 1, 4, ?, ?)",
            [(row["Kernel_Name"], int(row["Start_Timestamp"]), int(row["End_Timestamp"])) for row in sample_rows()],
        )
    trace = rocprof.KernelTrace()
    rocpd.read_kernels(path, trace)
    trace.finish()
    assert trace.dispatches == len(sample_rows()) and list(trace.busy_ns) == ["Agent 4"]
    assert trace.layouts == ["rocpd database (schema ?, kernels view)"]


def test_a_timestamp_that_is_no_number_counts_as_unreadable_and_a_file_that_is_no_database_is_skipped_with_a_warning(
    tmp_path,
):
    good = tmp_path / "gpuhost" / "834304_results.db"
    build_database(good)
    with closing(sqlite3.connect(good)) as db, db:
        db.execute(
            f"UPDATE rocpd_kernel_dispatch{UUID} SET start = 'N/A' WHERE id = 1"
        )  # typed loosely, as SQLite allows
    (tmp_path / "gpuhost" / "834305_results.db").write_bytes(b"not sqlite at all\n" * 100)
    metrics = parse_run(tmp_path)
    assert metrics.dispatch_count == len(sample_rows()) - 1
    assert "rocpd databases: 1 unreadable rows skipped (cut-off lines, N/A or negative durations)" in metrics.warnings
    assert any(
        w.startswith("gpuhost/834305_results.db: not a readable rocpd database") and w.endswith("file skipped")
        for w in metrics.warnings
    ), metrics.warnings


def test_the_database_is_opened_read_only_and_csv_output_beside_it_is_not_counted_twice(tmp_path):
    profile = tmp_path / "gpuhost"
    build_database(profile / "834304_results.db")
    shutil.copy(SAMPLE, profile / "834304_kernel_trace.csv")
    before = {p.name: p.read_bytes() for p in profile.iterdir()}
    metrics = parse_run(tmp_path)
    assert metrics.dispatch_count == len(sample_rows())
    assert "the CSV kernel traces hold the same dispatches" in metrics.sources["rocpd"]
    rocpd.read_agents(profile / "834304_results.db", [])
    rocpd.read_kernels(profile / "834304_results.db", rocprof.KernelTrace())
    assert {p.name: p.read_bytes() for p in profile.iterdir()} == before  # no journal, nothing written
