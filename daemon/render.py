"""Text for people: the run table, a run's status and the live progress line (standard library only)."""

from __future__ import annotations

import time
from typing import Any


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
    step, total = progress.get("step"), progress.get("max_steps")
    bar = ""
    if step is not None and total:
        filled = int(20 * min(step, total) / total)
        bar = "[" + "#" * filled + "." * (20 - filled) + "] "
    return bar + progress_text(progress)


def table(runs: list[dict[str, Any]]) -> str:
    rows = [("ID", "NAME", "STATE", "TARGET", "PROGRESS", "STARTED", "MESSAGE")]
    for r in runs:
        rows.append(
            (
                r["id"],
                (r.get("name") or "-")[:20],
                r.get("state", "?"),
                r.get("target", "-"),
                progress_text(r.get("progress")),
                _clock(r.get("created")),
                (r.get("message") or "")[:60],
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]) - 1)]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths)) + "  " + row[-1] for row in rows)


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
    lines = [
        f"run       {r['id']}" + (f"  ({r['name']})" if r.get("name") else ""),
        f"state     {r['state']}",
        f"message   {r.get('message') or '-'}",
        f"target    {r.get('target')}  {r.get('remote_dir') or ''}",
        f"command   {' '.join(r.get('command') or [])}",
        f"progress  {progress_text(r.get('progress'))}",
    ]
    snap = r.get("snapshot")
    if snap:
        lines.append(f"snapshot  {snap['checkpoint']} at step {snap['step']} ({snap['reason']})")
    stop = r.get("stop") or {}
    if stop.get("requested_at") and not snap and r["state"] == "running":
        lines.append(f"stop      requested ({stop.get('reason')}) at {_clock(stop['requested_at'])}, waiting for the snapshot")
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
    return "\n".join(lines)
