"""`obd train plot` and the loss sparkline of `obd train status`, on real runs of the tiny LoRA workload.

One daemon serves the module: a run stopped with a snapshot, the run resumed from it, and a
second run to overlay. Each chart is checked against the losses in the runs' own
metrics.jsonl, read here with nothing but `json`: every point must sit where the chart's own
axes say it should.
"""

from __future__ import annotations

import base64
import json
import os
import pty
import re
import shutil
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.conftest import REPO, DaemonProc, kill_leftover_jobs, wait_for

PY = sys.executable
WORKLOAD = str(REPO / "workloads" / "train_qwen_lora.py")
SVG = "{http://www.w3.org/2000/svg}"
Point = tuple[int, float]


@dataclass
class Runs:
    daemon: DaemonProc
    parent: str  # stopped with a snapshot at `snap`
    child: str  # resumed from it, ran to its end
    other: str  # an unrelated run, to overlay
    snap: int


def start(d: DaemonProc, *command: str, opts: tuple[str, ...] = ()) -> str:
    out = d.cli("train", "start", *opts, "--", *command)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


@pytest.fixture(scope="module")
def runs() -> Iterator[Runs]:
    root = Path(tempfile.mkdtemp(prefix="obd-", dir="/tmp"))
    d = DaemonProc(root)
    d.start()
    try:
        parent = start(d, PY, WORKLOAD, "--tiny", "--max_steps", "3000", opts=("--name", "lora"))

        def far_enough() -> bool:
            r = d.record(parent)
            assert r["state"] in ("preparing", "running"), r["message"]
            return bool(r["snapshots"]) and (r["progress"]["step"] or 0) >= 15

        wait_for(far_enough, 120, 0.1, "the run to reach step 15")
        stop = d.cli("train", "stop", parent, "--wait", "--json")
        assert stop.returncode == 0, stop.stdout + stop.stderr
        snap = json.loads(stop.stdout)["snapshot"]["step"]
        child = start(d, PY, WORKLOAD, "--tiny", "--max_steps", str(snap + 15), opts=("--resume-from", parent))
        other = start(
            d, PY, WORKLOAD, "--tiny", "--max_steps", "25", "--learning_rate", "3e-3", "--seed", "1",
            opts=("--name", "other"),
        )  # fmt: skip
        for rid in (child, other):
            assert d.wait_state(rid, "succeeded", "failed", timeout=180)["state"] == "succeeded"
        yield Runs(d, parent, child, other, snap)
    finally:
        d.stop()
        kill_leftover_jobs(d.state_dir)
        shutil.rmtree(root, ignore_errors=True)


def logged(d: DaemonProc, rid: str, metric: str = "loss") -> list[Point]:
    """(step, value) of every log line in the run's metrics.jsonl, as the job wrote them."""
    path = Path(d.record(rid)["remote_dir"]) / "metrics.jsonl"
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    return [(x["step"], x[metric]) for x in lines if x.get("event") == "log" and x.get(metric) is not None]


def chain(runs: Runs) -> list[Point]:
    """What the resumed run's curve must show: its parent's losses up to the snapshot, then its own."""
    return [p for p in logged(runs.daemon, runs.parent) if p[0] <= runs.snap] + logged(runs.daemon, runs.child)


# --- SVG -----------------------------------------------------------------------------------


def _axis(svg: ET.Element, cls: str, attr: str) -> tuple[float, float]:
    """(scale, offset) from data value to pixel, read from the chart's own tick labels."""
    ticks = [
        (float(t.get("data-value", "")), float(t.get(attr, "")))
        for t in svg.iter(f"{SVG}text")
        if t.get("class") == cls
    ]
    assert len(ticks) >= 2, f"fewer than two {cls} labels"
    (v0, p0), (v1, p1) = ticks[0], ticks[-1]
    scale = (p1 - p0) / (v1 - v0)
    return scale, p0 - scale * v0


def _polyline(group: ET.Element) -> list[tuple[float, float]]:
    line = group.find(f"{SVG}polyline")
    assert line is not None
    return [(float(x), float(y)) for x, y in (pair.split(",") for pair in line.get("points", "").split())]


def _curves(svg: ET.Element) -> dict[str, ET.Element]:
    return {g.get("data-run", ""): g for g in svg.iter(f"{SVG}g") if g.get("class") == "curve"}


def test_the_svg_of_a_resumed_run_draws_its_parents_losses_then_its_own_with_the_snapshot_and_resume_marked(
    runs: Runs, tmp_path: Path
) -> None:
    out = runs.daemon.cli("train", "plot", runs.child, "--svg", str(tmp_path / "loss.svg"))
    assert out.returncode == 0, out.stderr
    svg = ET.parse(tmp_path / "loss.svg").getroot()
    (sx, ox), (sy, oy) = _axis(svg, "x-tick", "x"), _axis(svg, "y-tick", "y")
    expected = chain(runs)
    drawn = _polyline(_curves(svg)[runs.child])
    assert len(drawn) == len(expected) > runs.snap
    for (step, loss), (x, y) in zip(expected, drawn, strict=True):
        assert abs(sx * step + ox - x) < 0.05 and abs(sy * loss + oy - y) < 0.05, (step, loss, x, y)

    group = _curves(svg)[runs.child]
    [snapshot] = [r for r in group.iter(f"{SVG}rect") if r.get("class") == "snapshot"]
    snap_loss = dict(logged(runs.daemon, runs.parent))[runs.snap]
    centre = (float(snapshot.get("x", "")) + 5, float(snapshot.get("y", "")) + 5)
    assert abs(centre[0] - (sx * runs.snap + ox)) < 0.05 and abs(centre[1] - (sy * snap_loss + oy)) < 0.05
    [resume] = [p for p in group.iter(f"{SVG}polygon") if p.get("class") == "resume"]
    first_step, _ = logged(runs.daemon, runs.child)[0]
    assert first_step == runs.snap + 1
    tip_x = max(float(xy.split(",")[0]) for xy in resume.get("points", "").split())
    assert abs(tip_x - 6 - (sx * first_step + ox)) < 0.05
    legend = " ".join(t.text or "" for t in svg.iter(f"{SVG}text"))
    assert f"resumed from {runs.parent}" in legend


def test_plot_json_gives_the_points_of_the_chain_and_its_marks_as_the_jobs_logged_them(runs: Runs) -> None:
    out = runs.daemon.cli("train", "plot", runs.child, runs.other, "--json")
    assert out.returncode == 0, out.stderr
    child, other = json.loads(out.stdout)
    assert child["runs"] == [runs.parent, runs.child] and child["metric"] == "loss"
    assert [tuple(p) for p in child["points"]] == chain(runs)
    assert [p[0] for p in child["snapshots"]] == [runs.snap]
    assert [p[0] for p in child["resumes"]] == [runs.snap + 1]
    assert [tuple(p) for p in other["points"]] == logged(runs.daemon, runs.other) and other["runs"] == [runs.other]


def test_several_runs_are_overlaid_in_distinct_colours_with_a_legend(runs: Runs, tmp_path: Path) -> None:
    out = runs.daemon.cli("train", "plot", runs.child, runs.other, "--svg", str(tmp_path / "both.svg"))
    assert out.returncode == 0, out.stderr
    svg = ET.parse(tmp_path / "both.svg").getroot()
    curves = _curves(svg)
    assert set(curves) == {runs.child, runs.other}
    colours = {rid: g.find(f"{SVG}polyline").get("stroke") for rid, g in curves.items()}  # type: ignore[union-attr]
    assert colours[runs.child] != colours[runs.other]
    (sy, oy) = _axis(svg, "y-tick", "y")
    drawn = _polyline(curves[runs.other])
    values = [v for _, v in logged(runs.daemon, runs.other)]
    assert len(drawn) == len(values)
    assert all(abs(sy * v + oy - y) < 0.05 for v, (_, y) in zip(values, drawn, strict=True))
    legend = [t.text or "" for t in svg.iter(f"{SVG}text")]
    assert f"{runs.other} (other)" in legend

    text = runs.daemon.cli("train", "plot", runs.child, runs.other, "--width", "100").stdout
    legend_lines = [line for line in text.splitlines() if runs.other in line or runs.child in line]
    marks = {line.split()[0] for line in legend_lines}
    assert len(legend_lines) == 2 and len(marks) == 2, text


# --- the terminal --------------------------------------------------------------------------


def _terminal_axes(lines: list[str]) -> tuple[dict[int, str], float, float, float, float, int]:
    """The plot rows (by index), row = a*value + b from the labelled rows, col = c*step + d from the ticks."""
    rows = {i: line for i, line in enumerate(lines) if re.match(r"^\s*[-\d.e+]*\s[┤│]", line)}
    labelled = [(float(line.split()[0]), i) for i, line in rows.items() if "┤" in line]
    (v0, r0), (v1, r1) = labelled[0], labelled[-1]
    a = (r1 - r0) / (v1 - v0)
    origin = rows[min(rows)].index("┤" if "┤" in rows[min(rows)] else "│") + 1
    axis_i = max(rows) + 1
    axis, under = lines[axis_i], lines[axis_i + 1]
    ticks = []
    for m in re.finditer(r"\d+", under.removesuffix("step")):
        col = next(c for c in range(m.start() - 1, m.end() + 1) if axis[c] == "┬")
        ticks.append((int(m.group()), col - origin))
    (s0, c0), (s1, c1) = ticks[0], ticks[-1]
    c = (c1 - c0) / (s1 - s0)
    return rows, a, r0 - a * v0, c, c0 - c * s0, origin


def test_the_terminal_chart_puts_each_logged_loss_where_its_axes_say(runs: Runs) -> None:
    out = runs.daemon.cli("train", "plot", runs.child, "--width", "110", "--height", "24")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0] == "loss by step"
    rows, a, b, c, d, origin = _terminal_axes(lines)
    expected = chain(runs)
    # A column that holds several steps shows the mean of their losses (a long run on a narrow
    # terminal), and which steps share a column is known here only as well as the rounded axis
    # labels tell. So around each column, some mark must lie between the lowest and the highest
    # loss logged there, give or take a row and a half of rounding (labels and marks sit on whole
    # rows and columns).
    columns: dict[int, list[float]] = {}
    for step, loss in expected:
        columns.setdefault(origin + round(c * step + d), []).append(loss)
    # The axis read from rounded ticks may put the first step a column left of the frame: its
    # losses still count, and marks are looked for only inside the frame.
    for col in columns:
        near = range(col - 1, col + 2)
        losses = [loss for j in near for loss in columns.get(j, [])]
        low, high = sorted((a * min(losses) + b, a * max(losses) + b))
        inside = [j for j in near if j >= origin]
        marked = [i for i, line in rows.items() for j in inside if j < len(line) and line[j] in "*SR"]
        assert marked, f"nothing drawn in column {col}:\n{out.stdout}"
        assert any(low - 1.5 <= i <= high + 1.5 for i in marked), (col, losses, marked, out.stdout)
    grid = "".join(rows.values())
    assert "S" in grid and "R" in grid
    assert f"resumed from {runs.parent}" in out.stdout and "S snapshot" in out.stdout
    assert f"loss {expected[-1][1]:.4g} at step {expected[-1][0]}" in out.stdout


def test_a_metric_no_run_logged_is_refused_with_those_it_did_log(runs: Runs) -> None:
    out = runs.daemon.cli("train", "plot", runs.other, "--metric", "accuracy")
    assert out.returncode == 2
    assert "no 'accuracy' values" in out.stderr and "learning_rate" in out.stderr and "--metric" in out.stderr
    lr = runs.daemon.cli("train", "plot", runs.other, "--metric", "learning_rate", "--width", "80")
    assert lr.returncode == 0 and lr.stdout.startswith("learning_rate by step")


def on_a_terminal(d: DaemonProc, *args: str) -> str:
    """What `obd ARGS` prints when its output is a terminal (a pseudo-terminal here)."""
    leader, follower = pty.openpty()
    proc = subprocess.Popen([PY, "-m", "daemon.cli", *args], env=d.env, cwd=REPO, stdout=follower, stderr=follower)
    os.close(follower)
    text = b""
    while True:
        try:
            chunk = os.read(leader, 65536)
        except OSError:  # the other end closed
            break
        if not chunk:
            break
        text += chunk
    assert proc.wait(30) == 0, text
    os.close(leader)
    return text.decode()


def _sparkline_line(text: str, losses: list[float]) -> None:
    [line] = [x for x in text.splitlines() if x.startswith("loss ")]
    spark = line.split()[1]
    assert len(spark) == len(losses) and set(spark) <= set("▁▂▃▄▅▆▇█")
    assert spark[losses.index(max(losses))] == "█" and spark[losses.index(min(losses))] == "▁"
    assert line.endswith(f"{losses[0]:.4g} → {losses[-1]:.4g} (last {len(losses)} logged)")


def test_status_on_a_terminal_shows_the_recent_loss_as_a_sparkline(runs: Runs) -> None:
    d = runs.daemon
    piped = d.cli("train", "status", runs.child)
    assert piped.returncode == 0 and "loss      " not in piped.stdout  # only for a person at a terminal
    _sparkline_line(on_a_terminal(d, "train", "status", runs.child), [v for _, v in logged(d, runs.child)][-40:])


def loop_run(d: DaemonProc, tmp_path: Path, log_call: str) -> str:
    """A finished custom-loop run of 30,000 steps whose step `step` logs with `log_call`."""
    job = tmp_path / "loop_job.py"
    job.write_text(
        "from trainer_plugin import loop\n"
        "loop.begin(max_steps=30000)\n"
        "for step in range(1, 30001):\n"
        f"    {log_call}\n"
        "loop.end(30000)\n"
    )
    rid = start(d, PY, str(job))
    assert d.wait_state(rid, "succeeded", "failed", timeout=120)["state"] == "succeeded"
    return rid


def test_the_sparkline_of_a_long_run_shows_its_last_losses(runs: Runs, tmp_path: Path) -> None:
    """A metrics.jsonl of megabytes: the sparkline is its end, not its first megabyte."""
    d = runs.daemon
    rid = loop_run(d, tmp_path, "loop.log_metrics(step, loss=1000.0 / step + (step % 7), note='x' * 60)")
    assert (Path(d.record(rid)["remote_dir"]) / "metrics.jsonl").stat().st_size > 3 << 20
    losses = [v for _, v in logged(d, rid)][-40:]
    _sparkline_line(on_a_terminal(d, "train", "status", rid), losses)


def test_the_sparkline_of_a_run_that_logs_its_loss_rarely_goes_back_far_enough(runs: Runs, tmp_path: Path) -> None:
    """A loss every 500 steps among lines without one (heartbeats): the last 40 losses lie 20,000 lines back."""
    d = runs.daemon
    rid = loop_run(
        d,
        tmp_path,
        "loop.log_metrics(step, loss=100.0 / step + (step % 1500) / 1000) if step % 500 == 0"
        " else loop.log_metrics(step, heartbeat=True)",
    )
    losses = [v for _, v in logged(d, rid)][-40:]
    assert len(losses) == 40
    _sparkline_line(on_a_terminal(d, "train", "status", rid), losses)


def test_a_read_of_the_metrics_can_start_at_their_last_lines(runs: Runs) -> None:
    d = runs.daemon
    path = Path(d.record(runs.child)["remote_dir"]) / "metrics.jsonl"
    reply = d.call("read", id=runs.child, file="metrics", tail_lines=2, limit=1 << 20)
    data = base64.b64decode(reply["data"])
    assert data.splitlines() == path.read_bytes().splitlines()[-2:]
    assert reply["offset"] == path.stat().st_size - len(data)


# --- PNG -----------------------------------------------------------------------------------


def test_a_png_draws_the_curve_across_the_plot(runs: Runs, tmp_path: Path) -> None:
    image = pytest.importorskip("matplotlib.image", reason="--png needs matplotlib (pip install 'obd-train[plot]')")
    path = tmp_path / "loss.png"
    out = runs.daemon.cli("train", "plot", runs.child, "--png", str(path))
    assert out.returncode == 0, out.stderr
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    pixels = image.imread(str(path))
    height, width = pixels.shape[:2]
    assert (width, height) == (900, 480)
    # The first curve's colour (#1f77b4): its pixels run across most of the width, from high to low.
    blue = [
        (x, y)
        for y in range(height)
        for x in range(width)
        if abs(pixels[y, x, 0] - 0x1F / 255) < 0.05
        and abs(pixels[y, x, 1] - 0x77 / 255) < 0.05
        and abs(pixels[y, x, 2] - 0xB4 / 255) < 0.05
    ]
    xs = [x for x, _ in blue]
    assert len(blue) > 300 and max(xs) - min(xs) > width * 0.6


def test_png_without_matplotlib_says_how_to_get_it_and_writes_nothing(runs: Runs, tmp_path: Path) -> None:
    blocker = tmp_path / "no-mpl" / "matplotlib"
    blocker.mkdir(parents=True)
    (blocker / "__init__.py").write_text("raise ImportError('matplotlib is not installed')\n")
    env = {"PYTHONPATH": f"{REPO}:{blocker.parent}"}
    out = runs.daemon.cli("train", "plot", runs.child, "--png", str(tmp_path / "x.png"), env=env)
    assert out.returncode == 2
    assert "pip install 'obd-train[plot]'" in out.stderr and "--svg" in out.stderr
    assert not (tmp_path / "x.png").exists()


# --- a fast client -------------------------------------------------------------------------


def test_listing_runs_imports_no_plotting_nor_daemon_library(runs: Runs) -> None:
    out = subprocess.run(
        [PY, "-X", "importtime", "-m", "daemon.cli", "train", "list"],
        env=runs.daemon.env,
        cwd=REPO,
        capture_output=True,
        text=True,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    imported = {line.split("|")[-1].strip().split(".")[0] for line in out.stderr.splitlines() if "|" in line}
    assert "daemon" in imported  # the listing is real
    assert imported.isdisjoint({"matplotlib", "pydantic", "anyio", "structlog", "torch", "numpy"}), imported
