"""Text for people: the run table, a run's status and the live progress line (standard library only).

Names, messages, commands, targets and reasons come from users and jobs; none reaches the
terminal raw. Control characters in them are printed as escapes (`printable`), so a run named
with an escape sequence or a newline cannot move the cursor, recolour or fake a line of output.
"""

from __future__ import annotations

import time
import unicodedata
from typing import Any

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
    return text


def progress_line(progress: dict[str, Any]) -> str:
    """The live line of `obd train logs --follow`: a bar and the progress text."""
    step, total = progress.get("step"), progress.get("max_steps")
    bar = ""
    if step is not None and total:
        filled = int(20 * min(step, total) / total)
        bar = "[" + "#" * filled + "." * (20 - filled) + "] "
    return printable(bar + progress_text(progress))


def table(runs: list[dict[str, Any]]) -> str:
    """The text of `obd train list`: one row per run, columns padded to their widest cell."""
    rows = [("ID", "NAME", "OWNER", "STATE", "TARGET", "PROGRESS", "STARTED", "MESSAGE")]
    for r in runs:
        # Escaped before they are cut and padded, so the widths are those of what is printed.
        rows.append(
            (
                printable(r["id"]),
                printable(r.get("name") or "-")[:20],
                printable(r.get("owner") or "-")[:16],
                printable(r.get("state", "?")),
                printable(r.get("target", "-")),
                printable(progress_text(r.get("progress"))),
                _clock(r.get("created")),
                printable(r.get("message") or "")[:60],
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]) - 1)]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=False)) + "  " + row[-1] for row in rows)


def pod_text(info: dict[str, Any], live: dict[str, Any]) -> str:
    """The pod line: id, state (Runpod's, while the daemon could ask; else obd's phase), rate, spend."""
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


def status(r: dict[str, Any]) -> str:
    """The text of `obd train status`: the run's fields, its pod if it has one, and its history."""
    lines = [
        f"run       {r['id']}" + (f"  ({r['name']})" if r.get("name") else ""),
        f"state     {r['state']}",
        f"message   {r.get('message') or '-'}",
        f"target    {r.get('target')}  {r.get('remote_dir') or ''}",
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
    if r.get("remote_dir") and r["state"] not in ("preparing",):
        lines.append(f"outputs   {r['remote_dir']}/output  (`obd train outputs {r['id']} --to DIR` copies them)")
    last = (r.get("progress") or {}).get("last_checkpoint")
    if last:
        lines.append(f"latest    {last}")
    if r.get("gpus"):
        lines.append(f"gpus      {','.join(r['gpus'])}")
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
    stop = r.get("stop") or {}
    if stop.get("requested_at") and not snap and r["state"] == "running":
        lines.append(
            f"stop      requested ({stop.get('reason')}) at {_clock(stop['requested_at'])}, waiting for the snapshot"
        )
    if r.get("resumed_from"):
        lines.append(f"resumed   from {r['resumed_from']} ({r.get('resume_checkpoint') or ''})")
    if r.get("exit_code") is not None:
        lines.append(f"exit      {r['exit_code']}")
    if r.get("unreachable_since"):
        lines.append(f"target    unreachable since {_clock(r['unreachable_since'])}; retrying")
    info = r.get("target_info") or {}
    if info.get("pod_id"):
        lines.append(f"pod       {pod_text(info, r.get('pod') or {})}")
    lines.append("history")
    for h in r.get("history") or []:
        lines.append(f"  {_clock(h['time'])}  {h['state']:<10} {h['reason']}")
    # Each line is escaped whole: every value in it, whoever wrote it, is shown as text.
    return "\n".join(printable(line) for line in lines)
