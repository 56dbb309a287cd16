"""`obd targets check NAME`: is a target usable? Reachable, host key, workdir, Python, torch, disk.

Each check is a dict {"check", "ok", "detail"}, in a fixed order, so the CLI can print a table
and exit non-zero if any failed. When an early check fails, the later ones say "not checked"
and why, instead of piling up errors that all have the same cause.

A target whose jobs run on compute nodes (Slurm: the `compute_nodes` capability) is also asked
whether its scheduler answers (`sinfo`), whether its partition exists, and whether the workdir
is shared (a file written where obd submits is read back on a node through a tiny `srun`);
Python, torch and the free disk are then checked on a compute node, where jobs run.
"""

from __future__ import annotations

import json
import time
from typing import Any, Protocol

from executors.base import AuthError, Executor, ExecutorError, HostKeyError, TargetUnreachable, WorkdirError

CHECKS = ["reachable", "host key known", "workdir writable", "python found", "torch found", "free disk"]
SCHEDULER_CHECKS = ["sinfo answers", "partition exists", "workdir shared"]


class ComputeNodes(Protocol):
    """A capability of targets whose jobs run on compute nodes other than the machine obd reaches."""

    @property
    def partition(self) -> str | None:
        """The partition jobs go to; None for the cluster's default."""
        ...

    def sinfo_argv(self) -> list[str]:
        """Lists the partitions as `name|availability|nodes|states` lines, the default one marked `*`."""
        ...

    def on_a_node(self, argv: list[str], *, seconds: int = 120) -> list[str]:
        """The command line that runs `argv` on one compute node."""
        ...


class PersistentHelper(Protocol):
    """A capability of targets whose polls go to a long-lived helper there (SSH: `jobctl.py serve`)."""

    async def check(self) -> tuple[bool, str]:
        """(usable, what serves the polls: "ok: ..." or "fallback: <why>; ...")."""
        ...


def check_names(executor: Executor) -> list[str]:
    """The checks `check_target` makes of this executor, in order."""
    helper = ["helper"] if getattr(executor, "remote_helper", None) is not None else []
    if getattr(executor, "compute_nodes", None) is None:
        return CHECKS + helper
    return [*CHECKS[:2], *SCHEDULER_CHECKS[:2], CHECKS[2], SCHEDULER_CHECKS[2], *CHECKS[3:], *helper]


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
    nodes: ComputeNodes | None = getattr(executor, "compute_nodes", None)
    workdir = await _reach(executor, items)
    if workdir is not None and nodes is not None and not await _scheduler_checks(executor, nodes, items, timeout):
        workdir = None
    if workdir is not None and not any(i["check"] == "workdir writable" for i in items):
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
        if nodes is not None and ok_so_far(items):
            await _shared_check(executor, nodes, probe, stamp, items, timeout)
    if workdir is not None and (nodes is None or ok_so_far(items)):
        await _python_checks(executor, workdir, items, min_free_gb, timeout, nodes)
    helper: PersistentHelper | None = getattr(executor, "remote_helper", None)
    if workdir is not None and helper is not None:
        try:
            items.append(_item("helper", *await helper.check()))
        except ExecutorError as exc:
            items.append(_item("helper", False, str(exc)))
    done = {i["check"] for i in items}
    failed = next((i for i in items if not i["ok"]), None)
    reason = f"not checked: {failed['check']} failed" if failed else "not checked"
    names = check_names(executor)
    items.extend(_item(c, False, reason) for c in names if c not in done)
    return sorted(items, key=lambda i: names.index(i["check"]))


def ok_so_far(items: list[dict[str, Any]]) -> bool:
    return all(i["ok"] for i in items)


async def _scheduler_checks(
    executor: Executor, nodes: ComputeNodes, items: list[dict[str, Any]], timeout: float
) -> bool:
    """`sinfo` answers and the partition exists (and is up); False when the later checks cannot be made."""
    try:
        result = await executor.run_command(nodes.sinfo_argv(), timeout=timeout)
    except ExecutorError as exc:
        items.append(_item("sinfo answers", False, str(exc)))
        return False
    if result.returncode != 0:
        why = _last_line(result.stderr) or f"exit {result.returncode}"
        items.append(_item("sinfo answers", False, f"{why}; is Slurm's client installed and its controller up?"))
        return False
    partitions: dict[str, tuple[str, str]] = {}
    default = None
    for line in result.stdout.decode(errors="replace").splitlines():
        name, _, rest = line.partition("|")
        if name.endswith("*"):
            name = default = name[:-1]
        avail, _, more = rest.partition("|")
        count, _, states = more.partition("|")
        known = partitions.get(name)
        partitions[name] = (avail, f"{known[1]}, {count} {states}" if known else f"{count} {states}")
    items.append(_item("sinfo answers", True, f"{len(partitions)} partitions: {', '.join(sorted(partitions))}"))
    wanted = nodes.partition or default
    if wanted is None or wanted not in partitions:
        what = f"partition {wanted!r} is not among" if wanted else "no default partition among"
        items.append(
            _item(
                "partition exists",
                False,
                f"{what} {', '.join(sorted(partitions)) or 'none'}; set `partition` for this target",
            )
        )
        return False
    avail, states = partitions[wanted]
    ok = avail == "up"
    detail = f"{wanted}{' (the default)' if not nodes.partition else ''}: {avail}, nodes {states}"
    items.append(_item("partition exists", ok, detail if ok else f"{detail}; jobs would wait until it is up"))
    return ok


async def _shared_check(
    executor: Executor, nodes: ComputeNodes, path: str, stamp: bytes, items: list[dict[str, Any]], timeout: float
) -> None:
    """The file just written where obd submits is read on a compute node: the workdir is shared."""
    try:
        result = await executor.run_command(nodes.on_a_node(["cat", path]), timeout=timeout)
    except ExecutorError as exc:
        items.append(_item("workdir shared", False, str(exc)))
        return
    if result.returncode == 0 and result.stdout == stamp:
        items.append(_item("workdir shared", True, f"a compute node reads {path} as written"))
        return
    why = _last_line(result.stderr) or f"it read {result.stdout[:80]!r}"
    items.append(
        _item(
            "workdir shared",
            False,
            f"a compute node could not read {path} ({why}); set `workdir` to a path every node mounts (home, /scratch)",
        )
    )


def _last_line(data: bytes) -> str:
    lines = data.decode(errors="replace").strip().splitlines()
    return lines[-1] if lines else ""


async def _python_checks(
    executor: Executor,
    workdir: str,
    items: list[dict[str, Any]],
    min_free_gb: float,
    timeout: float,
    nodes: ComputeNodes | None = None,
) -> None:
    try:
        python = await executor.python()
        argv = [python, "-c", _PROBE_PY, workdir]
        result = await executor.run_command(nodes.on_a_node(argv) if nodes else argv, timeout=timeout)
    except ExecutorError as exc:
        items.append(_item("python found", False, str(exc)))
        return
    try:
        info = json.loads(result.stdout.decode().strip().splitlines()[-1])
    except (ValueError, IndexError):
        tail = result.stderr.decode(errors="replace").strip().splitlines()[-1:] or [f"exit {result.returncode}"]
        items.append(_item("python found", False, f"{tail[0]}; set `python` or `venv` for this target"))
        return
    where = " on a compute node" if nodes else ""
    items.append(_item("python found", True, f"{info['python']} ({info['executable']}){where}"))
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
