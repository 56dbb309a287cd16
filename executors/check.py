"""`obd targets check NAME`: is a target usable? Reachable, host key, workdir, Python, torch, disk.

Each check is a dict {"check", "ok", "detail"}, in a fixed order, so the CLI can print a table
and exit non-zero if any failed. When an early check fails, the later ones say "not checked"
and why, instead of piling up errors that all have the same cause.
"""

from __future__ import annotations

import json
import time
from typing import Any

from executors.base import AuthError, Executor, ExecutorError, HostKeyError, TargetUnreachable, WorkdirError

CHECKS = ["reachable", "host key known", "workdir writable", "python found", "torch found", "free disk"]

# Runs with the target's Python: its version, torch's (if importable) and the free space of argv[1].
_PROBE_PY = r"""
import json, os, platform, shutil, sys
out = {"python": platform.python_version(), "executable": sys.executable}
try:
    import torch
    out["torch"] = torch.__version__
    out["accelerator"] = "rocm " + torch.version.hip if getattr(torch.version, "hip", None) else (
        "cuda " + torch.version.cuda if getattr(torch.version, "cuda", None) else "cpu only")
except Exception as exc:
    out["torch"] = None
    out["torch_error"] = type(exc).__name__ + ": " + str(exc)
path = sys.argv[1]
while path and not os.path.exists(path):
    path = os.path.dirname(path)
usage = shutil.disk_usage(path or "/")
out["free"], out["total"] = usage.free, usage.total
print(json.dumps(out))
"""


def _item(check: str, ok: bool, detail: str) -> dict[str, Any]:
    return {"check": check, "ok": ok, "detail": detail}


async def _reach(executor: Executor, items: list[dict[str, Any]]) -> str | None:
    """Reach the target and fill the first checks; return the workdir, or None to stop checking."""
    started = time.monotonic()
    try:
        reached = await executor.reach()
    except TargetUnreachable as exc:
        items.append(_item("reachable", False, str(exc)))
        return None
    except HostKeyError as exc:
        items.append(_item("reachable", True, "the host answered"))
        items.append(_item("host key known", False, str(exc)))
        return None
    except AuthError as exc:
        items.append(_item("reachable", False, f"the host answered but refused the login: {exc}"))
        return None
    except WorkdirError as exc:
        items.append(_item("reachable", True, "the host answered and let obd in"))
        items.append(_item("host key known", True, "verified before the workdir was tried"))
        items.append(_item("workdir writable", False, str(exc)))
        return None
    except ExecutorError as exc:
        items.append(_item("reachable", False, str(exc)))
        return None
    took = time.monotonic() - started
    items.append(_item("reachable", True, f"{reached.where}, reached in {took:.2f}s"))
    items.append(_item("host key known", True, reached.trust))
    return reached.workdir


async def check_target(executor: Executor, *, min_free_gb: float = 1.0, timeout: float = 60.0) -> list[dict[str, Any]]:
    """Run the checks of `obd targets check` against one target, in the order of CHECKS."""
    items: list[dict[str, Any]] = []
    workdir = await _reach(executor, items)
    if workdir is not None and len(items) < 3:
        probe = f"{workdir.rstrip('/')}/.obd/check"
        stamp = f"obd check {time.time()}\n".encode()
        try:
            await executor.put_file(probe, stamp)
            back = await executor.read_from(probe, 0, 4096)
            ok = back == stamp
            items.append(
                _item("workdir writable", ok, workdir if ok else f"{probe} did not read back what was written")
            )
        except ExecutorError as exc:
            items.append(_item("workdir writable", False, str(exc)))
    if workdir is not None:
        await _python_checks(executor, workdir, items, min_free_gb, timeout)
    done = {i["check"] for i in items}
    failed = next((i for i in items if not i["ok"]), None)
    reason = f"not checked: {failed['check']} failed" if failed else "not checked"
    items.extend(_item(c, False, reason) for c in CHECKS if c not in done)
    return items


async def _python_checks(
    executor: Executor, workdir: str, items: list[dict[str, Any]], min_free_gb: float, timeout: float
) -> None:
    try:
        python = await executor.python()
        result = await executor.run_command([python, "-c", _PROBE_PY, workdir], timeout=timeout)
    except ExecutorError as exc:
        items.append(_item("python found", False, str(exc)))
        return
    try:
        info = json.loads(result.stdout.decode().strip().splitlines()[-1])
    except (ValueError, IndexError):
        tail = result.stderr.decode(errors="replace").strip().splitlines()[-1:] or [f"exit {result.returncode}"]
        items.append(_item("python found", False, f"{tail[0]}; set `python` or `venv` for this target"))
        return
    items.append(_item("python found", True, f"{info['python']} ({info['executable']})"))
    if info.get("torch"):
        items.append(_item("torch found", True, f"{info['torch']} ({info.get('accelerator', '?')})"))
    else:
        items.append(
            _item(
                "torch found",
                False,
                f"not installed ({info.get('torch_error')}); install torch in that Python or set `venv`",
            )
        )
    free_gb = info["free"] / 1e9
    items.append(
        _item(
            "free disk",
            free_gb >= min_free_gb,
            f"{free_gb:.1f} GB free of {info['total'] / 1e9:.1f} GB at {workdir}"
            + ("" if free_gb >= min_free_gb else f" (less than {min_free_gb:g} GB)"),
        )
    )
