"""`obd pods list | rm POD_ID | retrieve RUN_ID`: the pods this obd install created on Runpod.

These talk to Runpod through the driver directly, not through the daemon, so they work when the
daemon is down: the way to find and remove a pod left behind whatever happened to obd. So the
API key they use is the one of the shell they run in (`RUNPOD_API_KEY`, or `runpod config`), not
the daemon's, and a missing or refused key says so.
Exit codes: 0 success, 1 an error (the message says what next), 2 bad usage.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any, NoReturn, TextIO

import anyio

from daemon.service.config import Config, RunpodTarget
from executors.base import ExecutorError
from executors.factory import makes_pods
from executors.runpod import PodBook, RunpodDriver
from executors.runpod.api import CLIENT_KEY_HELP
from trainer_plugin.rundir import is_run_id


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise _Usage(f"{self.prog}: {message}")


class _Usage(Exception):
    pass


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="obd pods", description="Pods obd created on Runpod (tagged obd-<run> and OBD_OWNER).")
    parser.add_argument("--target", help="the runpod target whose settings to use (default: the first one)")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    ls = sub.add_parser("list", help="list obd's pods with their state, rate and spend")
    ls.add_argument("--json", action="store_true")
    rm = sub.add_parser("rm", help="terminate one of obd's pods (its disk is lost)")
    rm.add_argument("pod_id")
    rm.add_argument("--force", action="store_true", help="also a pod that another obd install created")
    rt = sub.add_parser("retrieve", help="retrieve and verify a run's outputs from its pod, then terminate it")
    rt.add_argument("run_id")
    rt.add_argument("--to", type=Path, help="local directory (default: where obd put them before)")
    rt.add_argument("--keep", action="store_true", help="leave the pod up afterwards")
    return parser


def runpod_targets(config: Config) -> dict[str, RunpodTarget]:
    return {n: t for n, t in config.targets.items() if makes_pods(t)}


def driver_for(config: Config, name: str | None, **kwargs: Any) -> RunpodDriver:
    """The driver of the named runpod target, else of the first one, else of the defaults."""
    targets = runpod_targets(config)
    if name is not None and name not in targets:
        raise _Usage(
            f"obd pods: {name!r} is not a runpod target; the runpod targets are: {', '.join(targets) or 'none'}"
        )
    if name is None:
        name = next(iter(targets), "runpod")
    target = targets.get(name) or RunpodTarget(kind="runpod")
    assert config.daemon.state_dir is not None
    driver = RunpodDriver(name, target, config.daemon.state_dir, **kwargs)
    driver.api.key_help = CLIENT_KEY_HELP  # this process calls the API: its own key, not the daemon's
    return driver


def format_pods(pods: list[dict[str, Any]], now: float) -> str:
    """The `obd pods list` table."""
    if not pods:
        return "no pods created by this obd install"
    rows = [("POD", "RUN", "STATE", "GPU", "$/H", "SPEND $", "UP", "SSH")]
    for p in pods:
        up = now - p["started_at"] if p.get("started_at") else None
        gpu = f"{p.get('gpu_type') or '?'} x{p.get('gpu_count') or 1}"
        rows.append(
            (
                p["pod_id"],
                p.get("run_id") or "-",
                p.get("state") or "?",
                gpu,
                f"{p['cost_per_hr']:.2f}" if p.get("cost_per_hr") else "?",
                f"{p['spend_usd']:.2f}" if p.get("spend_usd") is not None else "?",
                _duration(up),
                p.get("ssh") or "-",
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows)


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "?"
    seconds = int(seconds)
    if seconds < 3600:
        return f"{seconds // 60}m"
    return f"{seconds // 3600}h{(seconds % 3600) // 60:02d}m"


async def _list(driver: RunpodDriver, as_json: bool, out: TextIO) -> int:
    pods = await driver.list_pods()
    print(json.dumps(pods, indent=1) if as_json else format_pods(pods, time.time()), file=out)
    return 0


async def _rm(driver: RunpodDriver, pod_id: str, force: bool, out: TextIO, err: TextIO) -> int:
    pod = await driver.api.get_pod(pod_id)
    if pod is None:
        print(f"pod {pod_id} does not exist (already terminated?); `obd pods list` shows obd's pods", file=err)
        return 1
    if not driver.is_ours(pod) and not force:
        print(
            f"pod {pod_id} ({pod.name or 'no name'}) was not created by this obd install; "
            f"remove it in the Runpod console, or with `obd pods rm {pod_id} --force`",
            file=err,
        )
        return 1
    await driver.terminate(pod_id)
    print(f"pod {pod_id} terminated", file=out)
    return 0


async def _retrieve(driver: RunpodDriver, run_id: str, to: Path | None, out: TextIO, err: TextIO) -> int:
    entry = driver.book.get(run_id)
    info = entry.target_info if entry else None
    if entry is None or info is None or not info.pod_id:
        print(f"obd has no pod on record for run {run_id}; `obd pods list` shows obd's pods", file=err)
        return 1
    remote_dir = entry.remote_dir or driver.ctx.remote_dir(info, run_id)
    local = to or (Path(entry.local_dir) if entry.local_dir else None)
    run_dir = driver.state_dir / "runs" / run_id
    if local is None and is_run_id(run_id) and run_dir.is_dir():
        local = run_dir / "retrieved"  # where the daemon puts a run's outputs
    if local is None:
        print(f"where should the outputs of {run_id} go? give a directory with --to DIR", file=err)
        return 2
    ok, message = await driver.finish(run_id, remote_dir, info, local)
    print(message, file=out if ok else err)
    return 0 if ok else 1


def _booked_target(config: Config, run_id: str) -> str | None:
    """The runpod target a run's pod was made for, as the pod book says (when it is still configured)."""
    state_dir = config.daemon.state_dir
    if state_dir is None:
        return None
    info = PodBook(state_dir).info(run_id)
    name = info.target if info is not None else None
    return name if name in runpod_targets(config) else None


def pods_main(
    argv: list[str], config: Config, *, out: TextIO | None = None, err: TextIO | None = None, **driver_kwargs: Any
) -> int:
    """Run `obd pods ARGV...` with this config; returns the exit code."""
    out, err = out or sys.stdout, err or sys.stderr
    try:
        args = build_parser().parse_args(argv)
        name = args.target
        if name is None and args.command == "retrieve":
            name = _booked_target(config, args.run_id)  # its own target's settings and workdir
        driver = driver_for(config, name, **driver_kwargs)
        if args.command == "retrieve" and args.keep:
            driver.target = driver.target.model_copy(update={"keep_pod": True})
    except _Usage as exc:
        print(exc, file=err)
        return 2
    except SystemExit as exc:  # --help
        return int(exc.code or 0)

    async def main() -> int:
        if args.command == "list":
            return await _list(driver, args.json, out)
        if args.command == "rm":
            return await _rm(driver, args.pod_id, args.force, out, err)
        return await _retrieve(driver, args.run_id, args.to, out, err)

    try:
        return anyio.run(main)
    except ExecutorError as exc:
        print(f"obd pods: {exc}", file=err)
        return 1
