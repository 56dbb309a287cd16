"""Loss curves from runs' metrics.jsonl: read over the socket, drawn in the terminal, as SVG or as PNG.

Standard library only, so `obd train plot` (and the web view, which reuses the reading part)
needs nothing installed; only `--png` imports matplotlib, the optional `obd-train[plot]` extra. A
curve follows a resumed run back through `resumed_from` to the first run of its chain, so a run
that was stopped and resumed reads as one line, with its snapshot and resume points marked.
"""

from __future__ import annotations

import base64
import itertools
import json
import math
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol
from xml.sax.saxutils import escape, quoteattr

from daemon.cli.render import printable
from daemon.common.wire import MAX_TAIL_LINES, READ_LIMIT

MAX_CHAIN = 100  # runs followed back through resumed_from; more means a loop or a mistake
PALETTE = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#17becf")
MARKS = ("*", "o", "+", "x", "#", "@", "%", "&")
ANSI = ("34", "33", "32", "31", "35", "36", "94", "91")
SPARKS = "▁▂▃▄▅▆▇█"
Point = tuple[int, float]


class Caller(Protocol):
    """What plotting needs of `daemon.cli.client.Client`: one call to the daemon."""

    def call(self, op: str, **params: Any) -> Any: ...


class PlotError(Exception):
    """Something the user can fix: a metric no run logged, a missing extra; `usage` picks exit code 2."""

    def __init__(self, message: str, usage: bool = True) -> None:
        super().__init__(message)
        self.usage = usage


@dataclass
class RunMetrics:
    """What one run's metrics.jsonl says: its `begin` line and every step's value of each metric."""

    begin: dict[str, Any] = field(default_factory=dict)
    series: dict[str, list[Point]] = field(default_factory=dict)

    def points(self, metric: str) -> list[Point]:
        return self.series.get(metric, [])


@dataclass
class Curve:
    """One line of a chart: a run and the runs it was resumed from, oldest first."""

    run_id: str
    label: str
    points: list[Point]
    snapshots: list[Point] = field(default_factory=list)  # where a run of the chain stopped with a snapshot
    resumes: list[Point] = field(default_factory=list)  # where a resumed run took over
    runs: list[str] = field(default_factory=list)  # the chain's run ids, oldest first
    note: str = ""  # why the chain stops short (a parent that cannot be read)


# --- reading -----------------------------------------------------------------------------


def _finite(value: object) -> float | None:
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
        return float(value)
    return None


def parse_metrics(data: bytes) -> RunMetrics:
    """The `begin` line and the numeric fields of every `log`/`metrics` line, by step.

    Only complete lines count (a running job may be writing the last one); lines that are not
    JSON objects, and values that are not finite numbers (null for NaN), are left out.
    """
    out = RunMetrics()
    complete = data[: data.rfind(b"\n") + 1]
    for raw in complete.splitlines():
        try:
            line = json.loads(raw)
        except ValueError:
            continue
        if not isinstance(line, dict):
            continue
        event = line.get("event")
        if event == "begin" and not out.begin:
            out.begin = line
            continue
        step = line.get("step")
        if event not in ("log", "metrics") or not isinstance(step, int) or isinstance(step, bool):
            continue
        for key, value in line.items():
            number = _finite(value)
            if number is not None and key not in ("step", "time", "event"):
                out.series.setdefault(key, []).append((step, number))
    for points in out.series.values():
        points.sort(key=lambda p: p[0])  # stable: a step logged twice keeps its order
    return out


def read_file(client: Caller, run_id: str, file: str = "metrics", offset: int = 0) -> tuple[bytes, int]:
    """A run's metrics.jsonl (or job.log) from `offset` to its end, and the offset after it."""
    chunks: list[bytes] = []
    while True:
        reply = client.call("read", id=run_id, file=file, offset=offset, limit=READ_LIMIT)
        data = base64.b64decode(reply.get("data", ""))
        chunks.append(data)
        offset = int(reply.get("next", offset + len(data)))
        if len(data) < READ_LIMIT:
            return b"".join(chunks), offset


def recent_values(client: Caller, run_id: str, metric: str = "loss", count: int = 40) -> list[float]:
    """The last `count` values of `metric` a run logged, reading only the end of its metrics.jsonl.

    The daemon finds where the file's last lines start; further back is read only while those
    hold too few values (heartbeat and evaluation lines come between the Trainer's logs).
    """
    lines = max(4 * count, 200)
    while True:
        reply = client.call("read", id=run_id, file="metrics", tail_lines=lines, limit=READ_LIMIT)
        data = base64.b64decode(reply.get("data", ""))
        if len(data) >= READ_LIMIT:  # the rest, up to the end of the file
            rest, _ = read_file(client, run_id, offset=int(reply.get("next", len(data))))
            data += rest
        values = [v for _, v in parse_metrics(data).points(metric)]
        if len(values) >= count or int(reply.get("offset", 0)) == 0 or lines >= MAX_TAIL_LINES:
            return values[-count:]
        lines = min(lines * 8, MAX_TAIL_LINES)


def run_label(record: dict[str, Any]) -> str:
    name = record.get("name")
    return printable(f"{record['id']} ({name})" if name else record["id"])


def is_sweep(answer: Any) -> bool:
    """Whether `status` answered for a sweep (its members' table) rather than for a run."""
    return isinstance(answer, dict) and "sweep" in answer and "members" in answer


def load_chain(client: Caller, ref: str, record: dict[str, Any] | None = None) -> tuple[list[dict[str, Any]], str]:
    """The run `ref` names (`record`, when already read) and the runs it was resumed from, oldest
    first, and why the chain stops short."""
    from daemon.cli.client import RequestFailed

    chain = [record if record is not None else client.call("status", id=ref)]
    seen = {chain[0]["id"]}
    note = ""
    while chain[0].get("resumed_from") and len(chain) < MAX_CHAIN:
        parent = chain[0]["resumed_from"]
        if parent in seen:
            break
        try:
            chain.insert(0, client.call("status", id=parent))
        except RequestFailed as exc:
            note = f"resumed from {parent}, which cannot be read ({exc})"
            break
        seen.add(parent)
    return chain, note


def join_chain(chain: list[tuple[dict[str, Any], RunMetrics]], metric: str) -> Curve:
    """One curve from the runs of a chain, oldest first: each run up to the step its successor resumed at."""
    last_record = chain[-1][0]
    curve = Curve(last_record["id"], run_label(last_record), [], runs=[r["id"] for r, _ in chain])
    for i, (record, metrics) in enumerate(chain):
        points = metrics.points(metric)
        if i + 1 < len(chain):
            cut = _resume_step(chain[i + 1][1], record)
            if cut is not None:
                points = [p for p in points if p[0] <= cut]
        if i > 0 and points:
            curve.resumes.append(points[0])
        curve.points.extend(points)
        snap = record.get("snapshot") or {}
        step = snap.get("step")
        if isinstance(step, int) and points:
            before = [p for p in points if p[0] <= step]
            if before:
                curve.snapshots.append((step, before[-1][1]))
    return curve


def _resume_step(child: RunMetrics, parent: dict[str, Any]) -> int | None:
    """The step a resumed run started from: its `begin` says; else its parent's snapshot."""
    start = child.begin.get("start_step")
    if isinstance(start, int) and not isinstance(start, bool):
        return start
    step = (parent.get("snapshot") or {}).get("step")
    return step if isinstance(step, int) else None


def load_curves(client: Caller, ref: str, metric: str) -> tuple[list[Curve], list[str]]:
    """The curves `ref` names: a run's (continued back through the runs it resumed), or one for
    each member of a sweep that logged `metric`; and, for a sweep, a note for each member that has
    nothing to plot yet (queued, or it logged no such value)."""
    from daemon.cli.client import RequestFailed

    answer = client.call("status", id=ref)
    if not is_sweep(answer):
        return [load_curve(client, ref, metric, answer)], []
    curves, notes = [], []
    title = printable(f"sweep {answer['sweep']}" + (f" ({answer['name']})" if answer.get("name") else ""))
    for member in answer.get("members") or []:
        values = " ".join(f"{k}={v}" for k, v in (member.get("values") or {}).items())
        try:
            curve = load_curve(client, member["id"], metric)
        except (PlotError, RequestFailed):
            notes.append(f"{title}: {member['id']} ({member.get('state')}) has no {metric!r} values yet; left out")
            continue
        if values:
            curve.label = printable(f"{curve.label} {values}")
        curves.append(curve)
    if not curves:
        members = ", ".join(m["id"] for m in answer.get("members") or []) or "none"
        raise PlotError(
            f"{title}: no member has {metric!r} values to plot yet (members: {members}); "
            f"`obd train status {ref}` shows where each is"
        )
    return curves, notes


def load_curve(client: Caller, ref: str, metric: str, record: dict[str, Any] | None = None) -> Curve:
    """The curve of `metric` for the run `ref` names, continued back through the runs it resumed."""
    records, note = load_chain(client, ref, record)
    chain = [(r, parse_metrics(read_file(client, r["id"])[0])) for r in records]
    curve = join_chain(chain, metric)
    curve.note = note
    if not curve.points:
        logged = sorted({k for _, m in chain for k in m.series})
        said = ", ".join(logged) if logged else "nothing yet (no log lines in its metrics.jsonl)"
        raise PlotError(
            f"run {curve.label} has no {metric!r} values to plot; it logged: {said}. "
            f"Pick one with `obd train plot {records[-1]['id']} --metric NAME`"
        )
    return curve


# --- scales ------------------------------------------------------------------------------


def nice_ticks(low: float, high: float, count: int = 5) -> list[float]:
    """Round tick values (1, 2, 2.5 or 5 times a power of ten) covering `low`..`high`."""
    if not high > low:
        return [low]
    raw = (high - low) / max(1, count)
    magnitude = 10 ** math.floor(math.log10(raw))
    step = next(m * magnitude for m in (1, 2, 2.5, 5, 10) if m * magnitude >= raw)
    first = math.ceil(low / step - 1e-9) * step
    ticks: list[float] = []
    tick = first
    while tick <= high + step * 1e-9:
        ticks.append(0.0 if abs(tick) < step * 1e-9 else tick)
        tick = first + step * len(ticks)
    return ticks


def tick_text(value: float) -> str:
    return f"{value:.4g}"


@dataclass(frozen=True)
class Scale:
    """The data ranges of a chart: steps along x, the metric along y (padded so no point sits on the frame)."""

    x_low: float
    x_high: float
    y_low: float
    y_high: float

    @classmethod
    def of(cls, curves: Iterable[Curve]) -> Scale:
        points = [p for c in curves for p in c.points]
        steps, values = [p[0] for p in points], [p[1] for p in points]
        x_low, x_high = min(steps), max(steps)
        y_low, y_high = min(values), max(values)
        if x_high == x_low:
            x_low, x_high = x_low - 1, x_high + 1
        pad = (y_high - y_low) * 0.05 or abs(y_high) * 0.05 or 1.0
        return cls(x_low, x_high, y_low - pad, y_high + pad)

    def fx(self, step: float) -> float:
        """0..1 along x."""
        return (step - self.x_low) / (self.x_high - self.x_low)

    def fy(self, value: float) -> float:
        """0 at the top, 1 at the bottom."""
        return (self.y_high - value) / (self.y_high - self.y_low)


# --- terminal ----------------------------------------------------------------------------


def sparkline(values: list[float]) -> str:
    """One character a value, from ▁ (lowest) to █ (highest)."""
    if not values:
        return ""
    low, high = min(values), max(values)
    span = high - low
    return "".join(SPARKS[int((v - low) / span * (len(SPARKS) - 1) + 0.5) if span else 3] for v in values)


def _column_values(curve: Curve, scale: Scale, columns: int) -> dict[int, float]:
    """The curve's value at each column it spans: the mean of the points in it, else interpolated."""
    buckets: dict[int, list[float]] = {}
    for step, value in curve.points:
        buckets.setdefault(round(scale.fx(step) * (columns - 1)), []).append(value)
    out = {c: sum(vs) / len(vs) for c, vs in buckets.items()}
    known = sorted(out)
    for a, b in itertools.pairwise(known):
        for c in range(a + 1, b):
            out[c] = out[a] + (out[b] - out[a]) * (c - a) / (b - a)
    return out


def terminal_chart(curves: list[Curve], metric: str, width: int = 80, height: int = 16, color: bool = False) -> str:
    """`metric` against the step as text: one mark (and colour) per curve, a legend, S/R at snapshots and resumes."""
    scale = Scale.of(curves)
    y_ticks = nice_ticks(scale.y_low, scale.y_high, max(2, height // 4))
    label_width = max(len(tick_text(t)) for t in y_ticks)
    columns = max(10, width - label_width - 2)
    rows = max(4, height)
    grid = [[" "] * columns for _ in range(rows)]
    colour = [[""] * columns for _ in range(rows)]

    def cell(step: float, value: float) -> tuple[int, int]:
        return round(scale.fy(value) * (rows - 1)), round(scale.fx(step) * (columns - 1))

    for curve in curves:
        for step, _ in curve.resumes:
            col = cell(step, scale.y_low)[1]
            for row in range(rows):
                grid[row][col] = ":"
    for i, curve in enumerate(curves):
        for col, value in _column_values(curve, scale, columns).items():
            row = round(scale.fy(value) * (rows - 1))
            grid[row][col], colour[row][col] = MARKS[i % len(MARKS)], ANSI[i % len(ANSI)]
    for i, curve in enumerate(curves):
        for marks, letter in ((curve.snapshots, "S"), (curve.resumes, "R")):
            for step, value in marks:
                row, col = cell(step, value)
                grid[row][col], colour[row][col] = letter, "1;" + ANSI[i % len(ANSI)]

    tick_rows = {round(scale.fy(t) * (rows - 1)): t for t in y_ticks}
    lines = [f"{metric} by step"]
    for r in range(rows):
        label = tick_text(tick_rows[r]).rjust(label_width) if r in tick_rows else " " * label_width
        body = "".join(
            f"\033[{colour[r][c]}m{grid[r][c]}\033[0m" if color and colour[r][c] else grid[r][c] for c in range(columns)
        )
        lines.append(f"{label} {'┤' if r in tick_rows else '│'}{body}")
    axis, under = ["─"] * columns, [" "] * (columns + 8)
    for tick in nice_ticks(scale.x_low, scale.x_high, max(2, columns // 12)):
        if tick != int(tick):
            continue
        col = round(scale.fx(tick) * (columns - 1))
        text = str(int(tick))
        start = max(0, col - len(text) // 2)
        if all(ch == " " for ch in under[max(0, start - 1) : start + len(text) + 1]):
            axis[col] = "┬"
            under[start : start + len(text)] = text
    lines.append(" " * label_width + " └" + "".join(axis))
    lines.append(" " * (label_width + 2) + "".join(under).rstrip() + "  step")
    for i, curve in enumerate(curves):
        mark = MARKS[i % len(MARKS)]
        shown = f"\033[{ANSI[i % len(ANSI)]}m{mark}\033[0m" if color else mark
        last = curve.points[-1]
        chain = f", resumed from {' -> '.join(curve.runs[:-1])}" if len(curve.runs) > 1 else ""
        lines.append(f"  {shown} {curve.label}: {metric} {tick_text(last[1])} at step {last[0]}{chain}")
        if curve.note:
            lines.append(f"    ({printable(curve.note)})")
    if any(c.snapshots or c.resumes for c in curves):
        lines.append("  S snapshot (the run stopped there)   R resumed (a new run took over)")
    return "\n".join(lines)


# --- SVG ---------------------------------------------------------------------------------

SVG_WIDTH, SVG_HEIGHT = 900, 480
MARGIN_LEFT, MARGIN_RIGHT, MARGIN_TOP, MARGIN_BOTTOM = 70, 20, 36, 50
LEGEND_LINE = 18


def _fmt(x: float) -> str:
    return f"{x:.2f}".rstrip("0").rstrip(".")


def svg_chart(curves: list[Curve], metric: str, width: int = SVG_WIDTH, height: int = SVG_HEIGHT) -> str:
    """A standalone SVG document of `metric` against the step, written by hand (no library)."""
    scale = Scale.of(curves)
    legend_height = LEGEND_LINE * (len(curves) + 1)
    total_height = height + legend_height
    plot_w, plot_h = width - MARGIN_LEFT - MARGIN_RIGHT, height - MARGIN_TOP - MARGIN_BOTTOM

    def px(step: float) -> float:
        return MARGIN_LEFT + scale.fx(step) * plot_w

    def py(value: float) -> float:
        return MARGIN_TOP + scale.fy(value) * plot_h

    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{total_height}" '
        f'viewBox="0 0 {width} {total_height}" font-family="sans-serif" font-size="12">',
        f'<rect width="{width}" height="{total_height}" fill="white"/>',
        f'<text x="{MARGIN_LEFT}" y="22" font-size="15" font-weight="bold">{escape(metric)} by step</text>',
        f'<g class="frame"><rect x="{MARGIN_LEFT}" y="{MARGIN_TOP}" width="{plot_w}" height="{plot_h}" '
        'fill="none" stroke="#999"/></g>',
    ]
    grid = ['<g class="y-ticks" stroke="#e5e5e5">']
    for tick in nice_ticks(scale.y_low, scale.y_high, 6):
        ty = _fmt(py(tick))
        grid.append(f'<line x1="{MARGIN_LEFT}" x2="{MARGIN_LEFT + plot_w}" y1="{ty}" y2="{ty}"/>')
        grid.append(
            f'<text class="y-tick" x="{MARGIN_LEFT - 6}" y="{ty}" dy="4" text-anchor="end" stroke="none" '
            f'fill="#333" data-value="{tick!r}">{tick_text(tick)}</text>'
        )
    grid.append("</g>")
    grid.append('<g class="x-ticks" stroke="#e5e5e5">')
    for tick in nice_ticks(scale.x_low, scale.x_high, 8):
        tx = _fmt(px(tick))
        grid.append(f'<line x1="{tx}" x2="{tx}" y1="{MARGIN_TOP}" y2="{MARGIN_TOP + plot_h}"/>')
        grid.append(
            f'<text class="x-tick" x="{tx}" y="{MARGIN_TOP + plot_h + 16}" text-anchor="middle" stroke="none" '
            f'fill="#333" data-value="{tick!r}">{tick_text(tick)}</text>'
        )
    grid.append("</g>")
    out += grid
    out.append(
        f'<text x="{MARGIN_LEFT + plot_w / 2}" y="{MARGIN_TOP + plot_h + 36}" text-anchor="middle" fill="#333">step</text>'
    )
    for i, curve in enumerate(curves):
        colour = PALETTE[i % len(PALETTE)]
        points = " ".join(f"{_fmt(px(s))},{_fmt(py(v))}" for s, v in curve.points)
        out.append(f'<g class="curve" data-run={quoteattr(curve.run_id)}>')
        for step, _ in curve.resumes:
            rx = _fmt(px(step))
            out.append(
                f'<line class="resume-line" x1="{rx}" x2="{rx}" y1="{MARGIN_TOP}" y2="{MARGIN_TOP + plot_h}" '
                f'stroke="{colour}" stroke-dasharray="4 3" opacity="0.6"/>'
            )
        out.append(f'<polyline fill="none" stroke="{colour}" stroke-width="1.6" points="{points}"/>')
        for step, value in curve.snapshots:
            x, y = px(step), py(value)
            out.append(
                f'<rect class="snapshot" x="{_fmt(x - 5)}" y="{_fmt(y - 5)}" width="10" height="10" '
                f'fill="white" stroke="{colour}" stroke-width="2"><title>snapshot at step {step}</title></rect>'
            )
        for step, value in curve.resumes:
            x, y = px(step), py(value)
            out.append(
                f'<polygon class="resume" points="{_fmt(x - 5)},{_fmt(y - 6)} {_fmt(x + 6)},{_fmt(y)} '
                f'{_fmt(x - 5)},{_fmt(y + 6)}" fill="{colour}"><title>resumed at step {step}</title></polygon>'
            )
        out.append("</g>")
    out.append(f'<g class="legend" transform="translate({MARGIN_LEFT},{height})">')
    for i, curve in enumerate(curves):
        y = i * LEGEND_LINE
        colour = PALETTE[i % len(PALETTE)]
        chain = f" (resumed from {' → '.join(curve.runs[:-1])})" if len(curve.runs) > 1 else ""
        out.append(f'<line x1="0" x2="24" y1="{y}" y2="{y}" stroke="{colour}" stroke-width="3"/>')
        out.append(f'<text x="32" y="{y + 4}">{escape(curve.label + chain)}</text>')
    y = len(curves) * LEGEND_LINE
    out.append(
        f'<rect x="2" y="{y - 5}" width="10" height="10" fill="white" stroke="#555" stroke-width="2"/>'
        f'<text x="18" y="{y + 4}">snapshot</text>'
        f'<polygon points="{90},{y - 6} {101},{y} {90},{y + 6}" fill="#555"/><text x="108" y="{y + 4}">resumed</text>'
    )
    out.append("</g></svg>")
    return "\n".join(out) + "\n"


# --- PNG (matplotlib, optional) ------------------------------------------------------------

PNG_MISSING = (
    "obd: --png draws with matplotlib, which is not installed here. Install it with "
    "`pip install 'obd-train[plot]'` (or `pip install matplotlib`), or write an SVG instead: "
    "`obd train plot RUN --svg FILE` needs nothing more"
)


def write_png(curves: list[Curve], metric: str, path: str) -> None:
    """A PNG of the chart, drawn by matplotlib (the `obd-train[plot]` extra), imported only here."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        from matplotlib import pyplot
    except ImportError as exc:
        raise PlotError(PNG_MISSING) from exc
    fig, ax = pyplot.subplots(figsize=(9, 4.8), dpi=100)
    try:
        for i, curve in enumerate(curves):
            colour = PALETTE[i % len(PALETTE)]
            chain = f" (resumed from {' → '.join(curve.runs[:-1])})" if len(curve.runs) > 1 else ""
            ax.plot(
                [p[0] for p in curve.points],
                [p[1] for p in curve.points],
                color=colour,
                lw=1.6,
                label=curve.label + chain,
            )
            for step, _ in curve.resumes:
                ax.axvline(step, color=colour, ls="--", lw=1, alpha=0.6)
            if curve.snapshots:
                ax.plot(
                    *zip(*curve.snapshots, strict=True),
                    ls="none",
                    marker="s",
                    ms=8,
                    mfc="white",
                    mec=colour,
                    mew=2,
                    label=f"snapshot ({curve.run_id})",
                )
            if curve.resumes:
                ax.plot(
                    *zip(*curve.resumes, strict=True),
                    ls="none",
                    marker=">",
                    ms=8,
                    color=colour,
                    label=f"resumed ({curve.run_id})",
                )
        ax.set_xlabel("step")
        ax.set_ylabel(metric)
        ax.set_title(f"{metric} by step")
        ax.grid(True, color="#e5e5e5")
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(path, format="png")
    finally:
        pyplot.close(fig)


def safe_metric(metric: str) -> str:
    """A metric name as the user gave it, checked: a JSON key of plain characters."""
    if not re.fullmatch(r"[A-Za-z0-9_./-]{1,100}", metric):
        raise PlotError(f"--metric {metric!r}: a metric is a key of the log lines, such as loss or learning_rate")
    return metric
