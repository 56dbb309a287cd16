"""Streaming parsers for rocprofv3's CSV output: kernel traces, counter collections, kernel stats and agent info.

The kernel trace is read one row at a time and folded into per-kernel totals, so a trace of
millions of dispatches takes memory in proportion to the number of distinct kernels, not rows.
Columns are found by name, which covers every published layout: ROCm 6.2 (no Thread_Id or
Dispatch_Id), 6.3/6.4 (Thread_Id, Dispatch_Id), 6.4+/7 (Stream_Id; LDS_Block_Size and register
columns) and `rocpd convert` (a leading Guid column; names matched whatever their case).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from runner.csvstream import TableSpec, normalise, parse_number, read_table

# Columns of a kernel trace, by the normalised spellings each has had.
TRACE_COLUMNS: dict[str, tuple[str, ...]] = {
    "name": ("kernelname", "kernel", "name"),
    "start": ("starttimestamp", "beginns", "startns", "start"),
    "end": ("endtimestamp", "endns", "end"),
    "kind": ("kind",),
    "agent": ("agentid", "gpuid"),
    "stream": ("streamid",),
    "thread": ("threadid",),
    "dispatch": ("dispatchid",),
    "guid": ("guid",),
}
STATS_COLUMNS: dict[str, tuple[str, ...]] = {
    "name": ("name", "kernelname"),
    "calls": ("calls",),
    "total": ("totaldurationns", "totalduration"),
}
# `counter_collection.csv` (`rocprofv3 --pmc ...`): one row per counter of each dispatch; since
# 2025 (ROCm 7) with the dispatch's Start/End_Timestamp, before that without any time.
COUNTER_COLUMNS: dict[str, tuple[str, ...]] = {
    "name": ("kernelname",),
    "counter": ("countername",),
    "value": ("countervalue",),
    "dispatch": ("dispatchid",),
    "correlation": ("correlationid",),
    "agent": ("agentid",),
    "process": ("processid",),
    "start": ("starttimestamp",),
    "end": ("endtimestamp",),
}
AGENT_COLUMNS: dict[str, tuple[str, ...]] = {
    "type": ("agenttype",),
    "name": ("name",),
    "product": ("productname",),
    "model": ("modelname",),
    "cu": ("cucount",),
    "clock": ("maxengineclkfcompute",),
    "gfx": ("gfxtargetversion",),
    "node": ("nodeid",),
    "logical": ("logicalnodeid",),
}
# The trace counts its bad rows across files (`KernelTrace.bad_rows`); agent info skips CPUs, not bad rows.
TRACE = TableSpec(
    TRACE_COLUMNS,
    ("name", "start", "end"),
    "kernel-trace header (Kernel_Name, Start_Timestamp, End_Timestamp)",
    skipped=None,
)
STATS = TableSpec(STATS_COLUMNS, ("name", "total"), "kernel-stats header (Name, TotalDurationNs)")
AGENTS = TableSpec(AGENT_COLUMNS, ("type",), "agent-info header (Agent_Type)", skipped=None)
COUNTERS = TableSpec(
    COUNTER_COLUMNS,
    ("name", "counter", "value"),
    "counter-collection header (Kernel_Name, Counter_Name, Counter_Value)",
)

# Rows are sorted in windows of this many before their intervals are merged: exact for a trace
# ordered to within this many dispatches per agent, and it bounds the memory the merge needs.
MERGE_WINDOW = 32768


@dataclass
class _Busy:
    """The union of one agent's kernel intervals, merged window by window."""

    window: list[tuple[int, int]] = field(default_factory=list)
    busy: int = 0
    cur_s: int = -1
    cur_e: int = -1
    floor: int = -1  # end of the last interval already counted in `busy`
    first: int | None = None
    last: int | None = None
    late: int = 0  # intervals that arrived after a later one had been counted

    def flush(self) -> None:
        chunk = self.window
        if not chunk:
            return
        chunk.sort()
        if self.first is None or chunk[0][0] < self.first:
            self.first = chunk[0][0]
        busy, cur_s, cur_e, floor, late = self.busy, self.cur_s, self.cur_e, self.floor, self.late
        for s, e in chunk:
            if cur_e < 0:
                cur_s, cur_e = s, e
            elif s > cur_e:
                busy += cur_e - cur_s
                floor = cur_e
                cur_s, cur_e = s, e
            elif s >= cur_s:
                # Once per overlapping dispatch: a comparison costs a seventh of a max() call.
                if e > cur_e:  # noqa: PLR1730
                    cur_e = e
            else:  # starts before the open interval: it came late, from an earlier window
                late += 1
                begin = max(s, floor)  # the part before `floor` is already counted
                if e <= begin:
                    continue
                if e >= cur_s:
                    cur_s = begin
                    cur_e = max(cur_e, e)
                else:
                    busy += e - begin
        self.busy, self.cur_s, self.cur_e, self.floor, self.late = busy, cur_s, cur_e, floor, late
        self.window = []

    def close(self) -> None:
        self.flush()
        if self.cur_e >= 0:
            self.busy += self.cur_e - self.cur_s
            self.last = self.cur_e if self.last is None else max(self.last, self.cur_e)
            self.cur_s = self.cur_e = -1


@dataclass
class KernelTrace:
    """Per-kernel totals of one or more kernel-trace files, and what was skipped reading them."""

    kernels: dict[str, list[int]] = field(default_factory=dict)  # name -> [calls, total ns]
    dispatches: int = 0
    kernel_ns: int = 0
    busy_ns: dict[str, int] = field(default_factory=dict)  # agent -> union of its kernel time
    span_ns: dict[str, int] = field(default_factory=dict)  # agent -> first start to last end
    files: list[str] = field(default_factory=list)
    layouts: list[str] = field(default_factory=list)
    other_kinds: int = 0
    bad_rows: int = 0
    csv_errors: int = 0
    late: int = 0
    warnings: list[str] = field(default_factory=list)
    _busy: dict[str, _Busy] = field(default_factory=dict)

    def totals(self) -> dict[str, tuple[int, float]]:
        return {name: (calls, float(ns)) for name, (calls, ns) in self.kernels.items()}

    def finish(self) -> None:
        """Close the interval merges; call once after the last file."""
        for agent, state in self._busy.items():
            state.close()
            self.busy_ns[agent] = self.busy_ns.get(agent, 0) + state.busy
            if state.first is not None and state.last is not None:
                self.span_ns[agent] = self.span_ns.get(agent, 0) + state.last - state.first
            self.late += state.late
        self._busy = {}
        if self.late:
            self.warnings.append(
                f"kernel traces: {self.late} dispatches arrived more than {MERGE_WINDOW} rows out of "
                "order; the GPU busy time is approximate"
            )


def describe_layout(index: dict[str, int]) -> str:
    """Which published layout a header is, from the optional columns it has."""
    if "guid" in index:
        return "rocpd convert (Guid column)"
    extras = [
        label
        for key, label in (("stream", "Stream_Id"), ("thread", "Thread_Id"), ("dispatch", "Dispatch_Id"))
        if key in index
    ]
    return "rocprofv3 (" + (", ".join(extras) if extras else "no Stream/Thread/Dispatch ids") + ")"


def read_kernel_trace(path: Path, trace: KernelTrace, label: str | None = None) -> None:
    """Fold one kernel-trace CSV into `trace`; a bad file adds a warning, never an exception."""
    with read_table(path, TRACE, trace.warnings, label) as table:
        if table is None:
            return
        trace.files.append(table.label)
        trace.layouts.append(describe_layout(table.index))
        _fold_rows(table.rows, table.index, trace)
        trace.csv_errors += table.errors


def _fold_rows(rows: Iterator[Sequence[Any]], index: dict[str, int], trace: KernelTrace) -> None:
    """The hot loop: one pass, per-kernel totals and per-agent interval windows.

    `rows` are a CSV's lists of strings or a database's tuples; `index` says where each column is.
    """
    i_name, i_start, i_end = index["name"], index["start"], index["end"]
    i_kind = index.get("kind", -1)
    i_agent = index.get("agent", -1)
    kernels = trace.kernels
    busy = trace._busy
    last_agent: str | None = None
    window: list[tuple[int, int]] = []
    state: _Busy | None = None
    dispatches = kernel_ns = other = bad = 0
    for row in rows:
        try:
            name = row[i_name]
            start = int(row[i_start])
            end = int(row[i_end])
            agent = row[i_agent] if i_agent >= 0 else ""
            if i_kind >= 0 and row[i_kind] != "KERNEL_DISPATCH":
                other += 1
                continue
        except (IndexError, ValueError, TypeError, OverflowError):  # a database's NULL or infinity too
            parsed = _slow_row(row, i_name, i_start, i_end, i_kind, i_agent)
            if parsed is None:
                bad += 1
                continue
            if isinstance(parsed, str):  # "other": a dispatch of another kind
                other += 1
                continue
            name, start, end, agent = parsed
        duration = end - start
        if duration < 0:
            bad += 1
            continue
        entry = kernels.get(name)
        if entry is None:
            kernels[name] = [1, duration]
        else:
            entry[0] += 1
            entry[1] += duration
        dispatches += 1
        kernel_ns += duration
        if agent != last_agent or state is None:
            state = busy.get(agent)
            if state is None:
                state = busy[agent] = _Busy()
            window = state.window
            last_agent = agent
        window.append((start, end))
        if len(window) >= MERGE_WINDOW:
            state.flush()
            window = state.window
    trace.dispatches += dispatches
    trace.kernel_ns += kernel_ns
    trace.other_kinds += other
    trace.bad_rows += bad


def _slow_row(
    row: Sequence[Any], i_name: int, i_start: int, i_end: int, i_kind: int, i_agent: int
) -> tuple[str, int, int, str] | str | None:
    """A row the fast path rejected: a repeated header, a float timestamp, a cut-off line, N/A, NULL."""
    if len(row) <= max(i_name, i_start, i_end, i_kind, i_agent):
        return None
    if normalise(str(row[i_start])) in TRACE_COLUMNS["start"]:
        return None  # a repeated header (files concatenated)
    if i_kind >= 0 and row[i_kind] != "KERNEL_DISPATCH":
        return "other"
    start, end = parse_number(str(row[i_start])), parse_number(str(row[i_end]))
    if start is None or end is None:
        return None
    return row[i_name], int(start), int(end), row[i_agent] if i_agent >= 0 else ""


def read_kernel_stats(path: Path, warnings: list[str], label: str | None = None) -> dict[str, tuple[int, float]]:
    """`kernel_stats.csv` (Name, Calls, TotalDurationNs, ...): name -> (calls, total ns).

    The file's own Percentage column is not used: percentages are recomputed from the totals
    so that a truncated file still adds up to 100.
    """
    out: dict[str, tuple[int, float]] = {}
    with read_table(path, STATS, warnings, label) as table:
        if table is None:
            return out
        i_name = table.index["name"]
        for row in table.rows:
            total = table.number(row, "total")
            if not table.fits(row) or total is None or total < 0:
                table.bad += 1
                continue
            name = row[i_name]
            prev_calls, prev_total = out.get(name, (0, 0.0))
            out[name] = (prev_calls + int(table.number(row, "calls") or 0), prev_total + total)
    return out


@dataclass
class CounterCollection:
    """What `counter_collection.csv` files measured: each counter summed over every dispatch, and the dispatches.

    A dispatch is one row per counter; it is counted once, by (file, process, agent, dispatch id).
    `timed` says whether every dispatch carried its start and end (the 2025 layout): only then
    are the dispatches, folded into `trace`, a kernel-time source.
    """

    counters: dict[str, float] = field(default_factory=dict)  # counter name -> sum over dispatches
    calls: dict[str, int] = field(default_factory=dict)  # kernel name -> dispatches
    trace: KernelTrace = field(default_factory=KernelTrace)
    untimed: int = 0  # dispatches without a start and end
    files: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    @property
    def dispatches(self) -> int:
        return sum(self.calls.values())

    @property
    def timed(self) -> bool:
        return self.dispatches > 0 and self.untimed == 0


def read_counter_collection(path: Path, out: CounterCollection, label: str | None = None) -> None:
    """Fold one `counter_collection.csv` into `out`; a bad file adds a warning, never an exception."""
    with read_table(path, COUNTERS, out.warnings, label) as table:
        if table is None:
            return
        out.files.append(table.label)
        file_key = len(out.files)
        seen: set[tuple[object, ...]] = set()
        timed: list[tuple[str, int, int, str]] = []
        for row in table.rows:
            value = table.number(row, "value")
            if not table.fits(row) or value is None:
                table.bad += 1
                continue
            counter, name = table.cell(row, "counter"), table.cell(row, "name")
            out.counters[counter] = out.counters.get(counter, 0.0) + value
            ident = table.cell(row, "dispatch") or table.cell(row, "correlation")
            key = (file_key, table.cell(row, "process"), table.cell(row, "agent"), ident, name)
            if key in seen:
                continue  # another counter of a dispatch already counted
            seen.add(key)
            out.calls[name] = out.calls.get(name, 0) + 1
            start, end = table.number(row, "start"), table.number(row, "end")
            if start is None or end is None:
                out.untimed += 1
            else:
                timed.append((name, int(start), int(end), table.cell(row, "agent")))
        _fold_rows(iter(timed), {"name": 0, "start": 1, "end": 2, "agent": 3}, out.trace)
        out.trace.files.append(table.label)
        out.trace.layouts.append(
            "counter collection (" + ("timestamps" if "start" in table.index else "no timestamps") + ")"
        )


@dataclass
class GpuAgent:
    """One GPU from `agent_info.csv`: what the peak-FLOPs estimate needs."""

    name: str  # the ISA, e.g. "gfx942"
    product: str
    cu_count: int | None
    max_clock_mhz: float | None
    gfx_target_version: int | None
    node_id: str = ""
    logical_node_id: str = ""
    source: str = "agent_info.csv"  # where it was read, for the sources of the numbers it gives


def read_agent_info(path: Path, warnings: list[str], label: str | None = None) -> list[GpuAgent]:
    """The GPU agents of `agent_info.csv` (Agent_Type GPU); CPUs are left out."""
    agents: list[GpuAgent] = []
    with read_table(path, AGENTS, warnings, label) as table:
        if table is None:
            return agents
        for row in table.rows:
            if table.cell(row, "type").strip().upper() != "GPU":
                continue
            cu = table.number(row, "cu")
            gfx = table.number(row, "gfx")
            agents.append(
                GpuAgent(
                    name=table.cell(row, "name").strip(),
                    product=table.cell(row, "product").strip() or table.cell(row, "model").strip(),
                    cu_count=int(cu) if cu else None,
                    max_clock_mhz=table.number(row, "clock") or None,
                    gfx_target_version=int(gfx) if gfx else None,
                    node_id=table.cell(row, "node").strip(),
                    logical_node_id=table.cell(row, "logical").strip(),
                )
            )
    return agents
