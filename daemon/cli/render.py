# Over 600 lines on purpose: every text obd prints for people, escaped in one place (a run's
# strings are hostile); split by what is shown (table, status, progress) is a later step.
"""Text for people: the run table, a run's status and the live progress line (standard library only).

Names, messages, commands, targets and reasons come from users and jobs; none reaches the
terminal raw. Control characters in them are printed as escapes (`printable`), so a run named
with an escape sequence or a newline cannot move the cursor, recolour or fake a line of output.
"""

from __future__ import annotations

import os
import sys
import time
import unicodedata
from collections.abc import Callable
from typing import Any

from daemon.common.wire import FINAL

# Characters that change how the text around them is laid out or read: C0/C1 controls
# (escape, newline, backspace...), line and paragraph separators, lone surrogates (which cannot
# even be encoded for the terminal) and the bidirectional overrides that reorder a line.
_ESCAPED_CATEGORIES = frozenset({"Cc", "Zl", "Zp", "Cs"})
_BIDI_CONTROLS = frozenset("\u061c\u200e\u200f\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069")
_SHORT_ESCAPES = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _escape(char: str) -> str:
    if char in _SHORT_ESCAPES:
        return _SHORT_ESCAPES[char]
    code = ord(char)
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def printable(value: object) -> str:
    r"""`value` as one line of text that is safe to print: control characters shown as escapes.

    `"a\x1b[2Jb"` -> `a\x1b[2Jb` and `"a\nb"` -> `a\nb`, as `repr` would write them, while
    letters, accents, CJK, emoji (joiners included) and spaces of every script stay as they are.
    """
    text = str(value)
    if text.isprintable():
        return text  # the usual case: nothing to look at character by character
    return "".join(
        _escape(char) if char in _BIDI_CONTROLS or unicodedata.category(char) in _ESCAPED_CATEGORIES else char
        for char in text
    )


def printable_lines(text: str) -> str:
    """Text of several lines made safe to print: its line breaks kept, every other control escaped."""
    return "\n".join(printable(line) for line in text.split("\n"))


def _clock(ts: float | None) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ts)) if ts else "-"


def duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    seconds = int(seconds)
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


def progress_text(progress: dict[str, Any] | None) -> str:
    progress = progress or {}
    step, total = progress.get("step"), progress.get("max_steps")
    if step is None:
        return "-"
    text = f"step {step}/{total}" if total else f"step {step}"
    if progress.get("loss") is not None:
        text += f" loss {progress['loss']:.4g}"
    if progress.get("eta_seconds") is not None:
        text += f" eta {duration(progress['eta_seconds'])}"
    phase = PHASE_WORDS.get(progress.get("phase") or "")
    if phase:  # where the time goes when it is not a training step: what a stop now cuts short
        text += f", {phase}"
    return text


# The plugin's phases (trainer_plugin/plugin/interrupt.py) other than training, as `status` and `list` say them.
PHASE_WORDS = {
    "evaluating": "evaluating",
    "saving": "saving a checkpoint",
    "loading_data": "loading data",
    "after_train": "after training",
}


def progress_line(progress: dict[str, Any]) -> str:
    """The live line of `obd train logs --follow`: a bar and the progress text."""
    step, total = progress.get("step"), progress.get("max_steps")
    bar = ""
    if step is not None and total:
        filled = int(20 * min(step, total) / total)
        bar = "[" + "#" * filled + "." * (20 - filled) + "] "
    return printable(bar + progress_text(progress))


def cells(text: str) -> int:
    """How many terminal columns `text` takes: wide (CJK, emoji) characters two, combining marks none."""
    if text.isascii():
        return len(text)
    total = 0
    for char in text:
        if unicodedata.combining(char) or char in "\u200b\u200d\ufe0f":
            continue
        total += 2 if unicodedata.east_asian_width(char) in "WF" else 1
    return total


def _cut(text: str, width: int, from_end: bool = False) -> str:
    """The longest start (or end) of `text` that takes at most `width` columns."""
    chars = reversed(text) if from_end else iter(text)
    kept: list[str] = []
    used = 0
    for char in chars:
        used += cells(char)
        if used > width:
            break
        kept.append(char)
    return "".join(reversed(kept)) if from_end else "".join(kept)


def shorten_middle(text: str, width: int) -> str:
    """`text` in at most `width` columns, its middle replaced by `…`: the end, where a message says
    what to do next (`see obd train logs ID`), is kept whole as far as it can be."""
    if cells(text) <= width:
        return text
    if width <= 1:
        return "…"[:width]
    head = (width - 1) // 3
    return _cut(text, head) + "…" + _cut(text, width - 1 - head, from_end=True)


def _pad(text: str, width: int) -> str:
    return text + " " * max(0, width - cells(text))


TABLE_COLUMNS = ("ID", "NAME", "OWNER", "STATE", "TARGET", "PROGRESS", "STARTED", "MESSAGE")
# Which columns a narrow terminal keeps, first to last; MESSAGE takes what is left (at least MIN_MESSAGE).
_KEEP_ORDER = ("ID", "STATE", "NAME", "PROGRESS", "TARGET", "OWNER", "STARTED")
MIN_MESSAGE = 20
NAME_WIDTH = 20


def _started(ts: float | None) -> str:
    return time.strftime("%Y-%m-%d %H:%M", time.localtime(ts)) if ts else "-"


def table(runs: list[dict[str, Any]], width: int | None = None) -> str:
    """The text of `obd train list`: one row per run, columns padded to their widest cell.

    With a `width` (the terminal's), columns are left out from the least needed (STARTED, OWNER,
    TARGET, PROGRESS) until MESSAGE has MIN_MESSAGE columns, and a message longer than the rest
    of the line is shortened in its middle, so the hint at its end survives. Without one (piped),
    every column is there and every message whole."""
    rows: list[dict[str, str]] = []
    for r in runs:
        # Escaped before they are measured and padded, so the widths are those of what is printed.
        rows.append(
            {
                "ID": printable(r["id"]),
                "NAME": _cut(printable(r.get("name") or "-"), NAME_WIDTH),
                "OWNER": shorten_middle(printable(r.get("owner") or "-"), 16),
                "STATE": printable(r.get("state", "?")),
                "TARGET": shorten_middle(printable(r.get("target", "-")), 20),
                "PROGRESS": printable(progress_text(r.get("progress"))),
                "STARTED": _started(r.get("created")),
                "MESSAGE": printable(_folded_message(r) if r.get("folded") else r.get("message") or ""),
            }
        )
    widths = {c: max([cells(c)] + [cells(row[c]) for row in rows]) for c in TABLE_COLUMNS}
    shown = [c for c in TABLE_COLUMNS if c != "MESSAGE"]
    if width is not None:
        used, keep = 0, set()
        for column in _KEEP_ORDER:
            if used + widths[column] + 2 + MIN_MESSAGE <= width or column == "ID":
                keep.add(column)
                used += widths[column] + 2
        shown = [c for c in shown if c in keep]
    room = None if width is None else max(MIN_MESSAGE, width - sum(widths[c] + 2 for c in shown))
    lines = []
    for row in [dict(zip(TABLE_COLUMNS, TABLE_COLUMNS, strict=True)), *rows]:
        message = row["MESSAGE"] if room is None else shorten_middle(row["MESSAGE"], room)
        lines.append(("  ".join(_pad(row[c], widths[c]) for c in shown) + "  " + message).rstrip())
    return "\n".join(lines)


def _folded_message(run: dict[str, Any]) -> str:
    """A folded sweep's row (daemon/service/run_list.py `fold`): its first member's message, how many
    are queued, and the command that shows each of them (last, where a shortened message keeps it)."""
    said = f"{run['folded']} members queued: obd train list --sweep {run['id']}"
    return f"{run['message']} ({said})" if run.get("message") else said


def _number(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, (int, float)) and not isinstance(value, bool) else "-"


def sweep_table(view: dict[str, Any], width: int | None = None) -> str:
    """The text of `obd train status SWEEP` and `obd train list --sweep SWEEP`: a line for the sweep
    (id, name, how many runs in each state), then one row per member: its grid values, state, step,
    last loss and the lowest loss logged (at its step), and its message, shortened to `width`."""
    members = view.get("members") or []
    names = list(view.get("grid") or {}) or list(dict.fromkeys(k for m in members for k in m.get("values") or {}))
    counts = view.get("counts") or {}
    if not counts:
        for m in members:
            counts[str(m.get("state"))] = counts.get(str(m.get("state")), 0) + 1
    said = ", ".join(f"{n} {state}" for state, n in sorted(counts.items()))
    head = f"sweep {view.get('sweep') or '-'}" + (
        f" ({view['name']})" if view.get("name") not in (None, view.get("sweep")) else ""
    )
    columns = ["#", "ID", "NAME", *names, "STATE", "STEP", "LOSS", "BEST", "MESSAGE"]
    rows = []
    for m in members:
        progress = m.get("progress") or {}
        step, total = progress.get("step"), progress.get("max_steps")
        best = _number(m.get("best_loss"))
        if best != "-" and m.get("best_step") is not None:
            best += f" @{m['best_step']}"
        values = m.get("values") or {}
        cells_of = [
            str(m.get("index") or "-"),
            m.get("id") or "-",
            m.get("name") or "-",
            *(values.get(n, "-") for n in names),
            m.get("state") or "?",
            "-" if step is None else f"{step}/{total}" if total else str(step),
            _number(progress.get("loss")),
            best,
            m.get("message") or "",
        ]
        rows.append([printable(c) for c in cells_of])
    widths = [max([cells(c)] + [cells(r[i]) for r in rows]) for i, c in enumerate(columns)]
    room = None if width is None else max(MIN_MESSAGE, width - sum(w + 2 for w in widths[:-1]))
    lines = [printable(f"{head}: {len(members)} runs" + (f": {said}" if said else ""))]
    for row in [columns, *rows]:
        message = row[-1] if room is None else shorten_middle(row[-1], room)
        lines.append(("  ".join(_pad(c, w) for c, w in zip(row[:-1], widths, strict=False)) + "  " + message).rstrip())
    return "\n".join(lines)


def outcome(record: dict[str, Any]) -> str:
    """`ID: cancelled by the user`: the state said once, whether or not the message starts with it."""
    state, message = str(record.get("state")), str(record.get("message") or "")
    text = message if message.startswith(state) else f"{state}: {message}" if message else state
    return printable(f"{record['id']}: {text}")


def size_text(size: int | None) -> str:
    if size is None:
        return ""
    value = float(size)
    for unit in ("B", "KB", "MB", "GB"):
        if value < 1000 or unit == "GB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1000
    return ""


def _ago(now: float, then: float | None) -> str:
    return f" {duration(max(0.0, now - then))} ago" if then else ""


def _cancel_asked_at(record: dict[str, Any]) -> float | None:
    for entry in reversed(record.get("history") or []):
        if str(entry.get("reason", "")).startswith("cancel requested"):
            return entry.get("time")
    return None


def wait_stage(
    record: dict[str, Any], now: float, size: str | None = None, width: int | None = None
) -> tuple[str, str]:
    """What a `stop --wait` or `cancel --wait` is waiting for, as (stage, a line for people).

    The stages follow a stop: the request written, the proof seen (with the checkpoint's size
    when it is known), the job exiting; or a cancel: TERM sent, the job exiting. ("", "") once
    the run has ended (the final record is printed instead). In `width` columns, the stage and
    how long ago it came (the line's head) stay whole: what is waited for is shortened first."""
    stage, head, tail = _stage_parts(record, now, size)
    if not head:
        return "", ""
    return stage, fit_head(printable(head), printable(tail), width)


def fit_head(head: str, tail: str, width: int | None) -> str:
    """`head; tail` in `width` columns: `tail` shortened in its middle before `head` is cut (a head
    alone is shortened in its middle, as any message)."""
    text = f"{head}; {tail}" if tail else head
    if width is None or cells(text) <= width:
        return text
    if not tail:
        return shorten_middle(head, width)
    room = width - cells(head) - 2
    if tail and room >= 12:
        return f"{head}; {shorten_middle(tail, room)}"
    return shorten_end(head, width)


def shorten_end(text: str, width: int) -> str:
    """`text` in at most `width` columns, its end replaced by `…` (its start is what counts)."""
    if cells(text) <= width:
        return text
    return _cut(text, max(width - 1, 0)) + "…"[: max(width, 0)]


def _stage_parts(record: dict[str, Any], now: float, size: str | None) -> tuple[str, str, str]:
    """(stage, what happened and how long ago, what is waited for); empty once the run ended."""
    state = str(record.get("state"))
    if state in FINAL:
        return "", "", ""
    stop = record.get("stop") or {}
    snapshot = record.get("snapshot")
    progress = progress_text(record.get("progress"))
    if state == "queued":
        return "queued", f"queued: {record.get('message') or 'waiting to start'}", ""
    if stop.get("cancel_by") == "fallback":
        return (
            "fallback",
            f"stop fallback: {stop.get('fallback') or 'cancelling'}",
            "TERM sent, KILL after the grace; waiting for the job to exit",
        )
    if stop.get("cancel_by") == "user":
        return (
            "cancel",
            f"cancel sent{_ago(now, _cancel_asked_at(record))}",
            "TERM to the job's processes, KILL after the grace; waiting for them to exit",
        )
    if snapshot:
        name = str(snapshot["checkpoint"]).rpartition("/")[2]
        extra = f" ({size})" if size else ""
        return (
            "proof",
            f"proof seen{_ago(now, stop.get('proof_at'))}: {name}{extra} at step {snapshot['step']}",
            "waiting for the job to exit",
        )
    if stop.get("requested_at"):
        at = f" at {progress}" if progress != "-" else ""
        return (
            "request",
            f"snapshot request written{_ago(now, stop['requested_at'])} ({stop.get('reason') or 'requested'})",
            f"waiting for the job to end its step{at}",
        )
    return state, f"{state}: {progress}", ""


def pod_text(info: dict[str, Any], live: dict[str, Any]) -> str:
    """The pod line: id, state (Runpod's, while the daemon could ask; else obd's phase), rate, spend.

    Once obd is done with the pod the record says what became of it (terminated or found gone,
    when and why; kept; left up), never the phase it had while it ran."""
    if info.get("end") or info.get("ended"):
        return pod_end_text(info)
    state = live.get("state") or info.get("phase") or "unknown"
    rate = live.get("cost_per_hr", info.get("cost_per_hr"))
    spend = live.get("spend_usd")
    parts = [f"{info['pod_id']}  {state}"]
    if live.get("gpu_type") or info.get("gpu_type"):
        parts.append(str(live.get("gpu_type") or info.get("gpu_type")))
    if isinstance(rate, (int, float)):
        parts.append(f"${rate:.2f}/h")
    if isinstance(spend, (int, float)):
        parts.append(f"${spend:.2f} spent so far")
    if live.get("error"):
        parts.append(f"(API: {live['error']})")
    return ", ".join(parts)


def pod_end_text(info: dict[str, Any]) -> str:
    """The pod line of a pod obd is done with: what became of it, when and why; its GPU, rate and
    total spend (up to its end, when it no longer exists)."""
    end, at = info.get("end"), info.get("ended_at")
    when = f" at {_clock(at)}" if at else ""
    state = {
        "terminated": f"terminated{when}",
        "gone": f"gone (found{when})",
        "kept": f"kept up{when}",
        "left up": f"left up{when}",
    }.get(str(end), "ended: obd is done with it (`obd pods list` shows whether it still exists)")
    parts = [f"{info['pod_id']}  {state}" + (f": {info['end_reason']}" if info.get("end_reason") else "")]
    if info.get("gpu_type"):
        parts.append(str(info["gpu_type"]))
    rate, started = info.get("cost_per_hr"), info.get("started_at")
    if isinstance(rate, (int, float)):
        parts.append(f"${rate:.2f}/h")
        if end in ("terminated", "gone") and isinstance(started, (int, float)) and isinstance(at, (int, float)):
            parts.append(f"${rate * max(0.0, at - started) / 3600:.2f} spent in all")
    return "; ".join(parts)


def slurm_text(job: dict[str, Any]) -> str:
    """The Slurm line: job id, Slurm's state, its nodes, and why it waits or ended when Slurm says."""
    parts = [f"job {job.get('job_id') or '?'}", str(job.get("state") or "unknown")]
    if job.get("nodes") and job.get("nodes") != "(null)":
        parts.append(f"on {job['nodes']}")
    if job.get("reason") and job.get("reason") != "None":
        parts.append(f"({job['reason']})")
    if job.get("exit_code"):
        parts.append(f"exit {job['exit_code']}")
    return " ".join(parts)


def _pod_line(r: dict[str, Any]) -> str | None:
    """A pod target's line: the pod its record keeps, with what the daemon's `status` said of it live."""
    info = r.get("target_info") or {}
    return pod_text(info, r.get("pod") or {}) if info.get("pod_id") else None


def _slurm_line(r: dict[str, Any]) -> str | None:
    """A Slurm target's line: the job as the daemon's `status` said it."""
    return slurm_text(r["slurm"]) if r.get("slurm") else None


# What a kind of target adds to `obd train status`, under its label: each from what the target's
# supervision put in the daemon's reply (the record's pod, a Slurm job), None where it put nothing.
# The one place the client knows what only some kinds of target say.
TARGET_LINES: tuple[tuple[str, Callable[[dict[str, Any]], str | None]], ...] = (
    ("pod", _pod_line),
    ("slurm", _slurm_line),
)


def finish_text(r: dict[str, Any]) -> str | None:
    """For a run that ended stopped for a snapshot: "stopped at step N of M; resume to finish" and how.

    Such a run did not train to its end; its outputs are the snapshot's, not a final model
    (`obd train outputs --checkpoint final` refuses them). None for any other run.
    """
    snap = r.get("snapshot")
    if str(r.get("state")) not in FINAL or not snap:
        return None
    total = (r.get("progress") or {}).get("max_steps")
    of = f" of {total}" if total else ""
    reached = (r.get("limits") or {}).get("reached")
    if reached:  # obd stopped it at its chain's limit (docs/limits.md): no retry comes
        return f"stopped at its {reached}, at step {snap['step']}{of}; resume with `obd train resume {r['id']}`"
    text = f"stopped at step {snap['step']}{of}; resume to finish"
    if r.get("retried_by"):
        return f"{text}: resumed as {r['retried_by']}"
    return f"{text}: `obd train resume {r['id']}`"


def limits_text(usage: dict[str, Any]) -> str:
    """The limits line of `status`: each limit of the chain, used and left; the GPUs and the price
    counted; the limit it stopped at."""
    parts = []
    if usage.get("time_limit"):
        t = usage["time_limit"]
        parts.append(f"time {duration(t['used'])} of {duration(t['limit'])} ({duration(t['left'])} left)")
    if usage.get("deadline"):
        d = usage["deadline"]
        parts.append(
            f"deadline {_clock(d['at'])} ({duration(d['left'])} left)"
            if d["left"]
            else f"deadline {_clock(d['at'])} (passed)"
        )
    if usage.get("gpu_hours"):
        g = usage["gpu_hours"]
        parts.append(f"GPU-hours {g['used']:.3g} of {g['limit']:g} ({g['left']:.3g} left)")
    if usage.get("cost_usd"):
        c = usage["cost_usd"]
        parts.append(f"cost ${c['used']:.2f} of ${c['limit']:.2f} (${c['left']:.2f} left)")
    counted = f"{usage.get('gpus') or 0} GPU{'s' if usage.get('gpus') != 1 else ''}"
    if usage.get("usd_per_hour") is not None:
        counted += f" at ${usage['usd_per_hour']:.2f}/h"
    text = "; ".join(parts) + f" ({counted})"
    if usage.get("reached"):
        text += f"; stopped at its {usage['reached']}"
    return text


def checkpoints_text(c: dict[str, Any]) -> str:
    """The disk a chain's checkpoints use, and its keep setting (docs/checkpoints.md)."""
    n = len(c.get("checkpoints") or [])
    keep = f"keeping the newest {c['keep']} complete" if c.get("keep") else "keeping all"
    text = f"{size_text(c.get('bytes') or 0)} in {n} checkpoint{'s' if n != 1 else ''} of its chain, {keep}"
    if c.get("pruned"):
        text += f"; {c['pruned']} pruned ({size_text(c.get('pruned_bytes') or 0)} freed)"
    return text


def pruned_text(answer: dict[str, Any]) -> str:
    """What `obd train prune` did: each checkpoint deleted, the bytes freed, what it could not."""
    removed = answer.get("removed") or []
    lines = [f"removed   {r['name']} of {r['run']} ({size_text(r['bytes'])})" for r in removed]
    lines += [
        f"kept      {k['name']} of {k['run']} ({size_text(k['bytes'])}): {k['why']}" for k in answer.get("kept") or []
    ]
    lines += [f"error     {e}" for e in answer.get("errors") or []]
    n = len(removed)
    lines.append(
        f"freed {size_text(answer.get('freed') or 0)} ({n} checkpoint{'s' if n != 1 else ''}), "
        f"keeping the newest {answer.get('keep')} complete"
    )
    return "\n".join(printable(line) for line in lines)


def gpus_text(r: dict[str, Any]) -> str | None:
    """The GPU line of `status`: the device ids the run holds (`gpu       device 0`, `gpus      devices
    0,1`), or `none (CPU only)` for a run that asked for none (`--gpus 0`): a bare `gpus 0` read as
    "no GPU". None where obd hands out no device (queued, ended, or a kind whose machine gives them)."""
    held = [str(g) for g in r.get("gpus") or []]
    if len(held) == 1:
        return f"gpu       device {held[0]}"
    if held:
        return f"gpus      devices {','.join(held)}"
    if r.get("gpus_wanted") in (0, []):
        return "gpus      none (CPU only)"
    return None


def own_python(r: dict[str, Any]) -> str | None:
    """Why a local job's `python` is obd's own (this command's venv, whose `bin/` was on the PATH the
    job started from: it has no torch, and the user's venv is bypassed), or None."""
    python = (r.get("job") or {}).get("python")
    if r.get("target") != "local" or not python or sys.prefix == sys.base_prefix:
        return None
    if os.path.dirname(python) != os.path.join(sys.prefix, "bin"):
        return None
    return (
        f"the job's python is obd's own ({python}): obd's venv bin/ is on the PATH it started from; "
        "take it off PATH (link only `obd`) or name your venv's python (README: Installing)"
    )


def no_plugin_text(r: dict[str, Any]) -> str | None:
    """Why a stop asked of a run can bring no snapshot as its job runs now (the daemon's
    `stop.no_plugin`: it never loaded obd's plugin), and what to do; None when one can still come."""
    why = (r.get("stop") or {}).get("no_plugin")
    if not why or r.get("state") in FINAL or r.get("snapshots"):
        return None
    return printable(
        f"run {r['id']}: no snapshot can come: {why}; the request stays (a Python it starts later takes it at its "
        f"first step) and the job runs on; `obd train cancel {r['id']}` ends it now"
    )


def carry_text(progress: dict[str, Any] | None) -> str:
    """A checkpoint carried in from another target (`move`, `resume --target`): bytes and rate."""
    p = progress or {}
    total, done = p.get("carry_total"), p.get("carry_bytes")
    if total is None or done is None:
        return ""
    rate = f" at {p['carry_rate'] / 1e6:.1f} MB/s" if p.get("carry_rate") else ""
    share = f" ({100 * done / total:.0f}%)" if total else ""
    return f"{done / 1e6:.1f} of {total / 1e6:.1f} MB of its checkpoint arrived{share}{rate}"


MOVE_STATES = {
    "snapshot": "a snapshot asked here first",
    "starting": "its resume there being made",
    "carrying": "its checkpoint being carried to run {run} there",
    "done": "done: run {run} trains there",
    "failed": "failed: {why}",
}


def move_text(r: dict[str, Any]) -> str:
    """Where `obd train move` of this run stands (its record's `move`)."""
    m = r.get("move") or {}
    said = MOVE_STATES.get(str(m.get("state")), str(m.get("state"))).format(run=m.get("run"), why=m.get("why"))
    return printable(f"to target {m.get('to')}: {said}")


def status(r: dict[str, Any]) -> str:
    """The text of `obd train status`: the run's fields, its pod if it has one, and its history."""
    lines = [
        f"run       {r['id']}" + (f"  ({r['name']})" if r.get("name") else ""),
        f"state     {r['state']}",
        f"message   {r.get('message') or '-'}",
        f"target    {r.get('target')}  {r.get('remote_dir') or ''}",
        *([f"placed    {(r.get('placement') or {}).get('why')}"] if (r.get("placement") or {}).get("why") else []),
        f"command   {' '.join(r.get('command') or [])}",
        f"progress  {progress_text(r.get('progress'))}",
    ]
    job = r.get("job") or {}
    if r.get("owner"):
        lines.insert(2, f"owner     {r['owner']}")
    if job.get("cwd") or job.get("python"):
        lines.append(
            f"job       in {job.get('cwd') or '-'}; program {job.get('executable') or '-'}; python {job.get('python') or '-'}"
        )
    own = own_python(r)
    if own is not None:
        lines.append(f"warning   {own}")
    if r.get("remote_dir") and r["state"] not in ("preparing",):
        lines.append(
            f"outputs   {r['remote_dir']}/output  ($OBD_OUTPUT_DIR; the Trainer's output_dir is put there, other "
            f"paths the script writes are not; `obd train outputs {r['id']} --to DIR` copies it)"
        )
    last = (r.get("progress") or {}).get("last_checkpoint")
    if last:
        lines.append(f"latest    {last}")
    stop = (r.get("progress") or {}).get("stop_seconds")
    if stop is not None and r["state"] == "running":
        lines.append(f"stop      ~{duration(stop)} from a request to its proof now (a safe point, then the save)")
    carried = carry_text(r.get("progress"))
    if carried:
        lines.append(f"carry     {carried}")
    if r.get("move"):
        lines.append(f"move      {move_text(r)}")
    gpus = gpus_text(r)
    if gpus is not None:
        lines.append(gpus)
    if r.get("reconciling"):
        lines.append(
            "reconcile still being matched with its target after the daemon's start (the target has not answered yet)"
        )
    # In the record's preemption part (flat in a record of a daemon before the parts).
    paused = (r.get("preemption") or r).get("paused") if r.get("state") == "queued" else None
    if paused:
        for_what = f"run {paused['by']}" if paused.get("by") else "a drain of its target"
        lines.append(
            f"paused    for {for_what} since {_clock(paused['since'])}; it resumes on its own from its snapshot"
        )
    pauses = r.get("pauses") or {}
    if pauses.get("preemptions"):
        n = pauses["preemptions"]
        lines.append(
            f"pauses    {n} time{'s' if n != 1 else ''}, {duration(pauses.get('paused_seconds') or 0)} in all, "
            f"{pauses.get('lost_steps') or 0} steps lost"
        )
    if r.get("usage"):
        lines.append(f"limits    {limits_text(r['usage'])}")
    queue = r.get("queue") or {}
    if queue:
        lines.append(f"queue     position {queue.get('position') or '-'}; {queue.get('waiting_for') or ''}")
    if r.get("retries"):
        chain = "; ".join(f"{a['id']} {a['state']}" for a in r.get("chain_runs") or [])
        lines.append(f"attempt   {r.get('attempt', 1)} of {r['retries'] + 1}" + (f" ({chain})" if chain else ""))
    if r.get("resume_reason"):
        lines.append(f"trusted   {r['resume_reason']}")
    snap = r.get("snapshot")
    if snap:
        lines.append(f"snapshot  {snap['checkpoint']} at step {snap['step']} ({snap['reason']})")
    finish = finish_text(r)
    if finish:
        lines.append(f"finish    {finish}")
    stop = r.get("stop") or {}
    if stop.get("requested_at") and not snap and r["state"] == "running":
        lines.append(
            f"stop      requested ({stop.get('reason')}) at {_clock(stop['requested_at'])}, waiting for the snapshot"
        )
    if r.get("resumed_from"):
        lines.append(f"resumed   from {r['resumed_from']} ({r.get('resume_checkpoint') or ''})")
    if r.get("checkpoints"):
        lines.append(f"disk      {checkpoints_text(r['checkpoints'])}")
    for bad in r.get("bad_checkpoints") or []:
        lines.append(f"bad       {bad['name']} of {bad['run']}: {bad['why']}; never resumed from again")
    if r.get("exit_code") is not None:
        lines.append(f"exit      {r['exit_code']}")
    if r.get("unreachable_since"):
        lines.append(f"target    unreachable since {_clock(r['unreachable_since'])}; retrying")
    for label, line in TARGET_LINES:
        text = line(r)
        if text is not None:
            lines.append(f"{label:<9} {text}")
    lines.append("history")
    for h in r.get("history") or []:
        lines.append(f"  {_clock(h['time'])}  {h['state']:<10} {h['reason']}")
    # Each line is escaped whole: every value in it, whoever wrote it, is shown as text.
    return "\n".join(printable(line) for line in lines)
