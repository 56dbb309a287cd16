"""The commands that run obd's machinery in the `obd` command's own process, reached from the
client only through its one door (daemon/cli/machinery.py): `obd daemon` (the service itself), and
`obd targets check` and `obd pods`, which read the config and talk to targets directly (so they
work when the daemon is down)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from daemon.service.config import Config

EXIT_USAGE = 2  # the command's code for bad usage (daemon/cli/main.py)


def run_daemon(args: argparse.Namespace) -> int:
    """`obd daemon`: the service, in this process, until it is stopped."""
    import anyio

    from daemon.service.children import wait_on_children_by_pidfd
    from daemon.service.config import ConfigError, load_config
    from daemon.service.daemon import Daemon
    from daemon.service.log import configure

    try:
        config = load_config(
            Path(args.config) if args.config else None,
            state_dir=Path(args.state_dir) if args.state_dir else None,
            socket=Path(args.socket) if args.socket else None,
        )
    except ConfigError as exc:
        print(f"obd: {exc}", file=sys.stderr)
        return EXIT_USAGE
    try:
        configure(args.log_level or config.daemon.log_level)
    except ValueError as exc:
        print(f"obd: [daemon] {exc}", file=sys.stderr)
        return EXIT_USAGE
    wait_on_children_by_pidfd()  # no thread started, and waited for, for each run launched
    anyio.run(Daemon(config).run)
    # A worker thread may still sit in a call to a remote that does not answer (a hung cloud API),
    # abandoned on purpose: it must not hold the exit up. Everything the daemon keeps is on disk.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def admin_main(args: argparse.Namespace) -> int:
    """`obd targets check NAME` and `obd pods ...`, with the daemon's config read here."""
    import anyio

    from daemon.service.config import ConfigError, load_config
    from daemon.service.log import configure

    configure("warning")  # log lines go to stderr, so --json output stays clean

    try:
        config = load_config(Path(args.config) if args.config else None)
    except ConfigError as exc:
        print(f"obd: {exc}", file=sys.stderr)
        return EXIT_USAGE
    if args.cmd == "targets":
        return anyio.run(_check, config, args.name, args.json)
    from daemon.service.pods_admin import pods_main

    return pods_main(list(getattr(args, "unknown", [])) + args.rest, config)


async def _check(config: Config, name: str, as_json: bool) -> int:
    """`obd targets check NAME`: the checks of executors/check.py against the target's executor."""
    from daemon.service.config import ConfigError
    from executors.base import ExecutorError
    from executors.check import check_target
    from executors.factory import make_executor, makes_pods

    try:
        target = config.target(name)
    except ConfigError as exc:
        print(f"obd: {exc}", file=sys.stderr)
        return 2
    if makes_pods(target):
        print("obd: `targets check` covers local and ssh targets; for pods use `obd pods list`", file=sys.stderr)
        return 2
    assert config.daemon.state_dir is not None
    try:
        executor = make_executor(name, target, config.daemon.state_dir)
    except ExecutorError as exc:
        print(f"obd: {exc}", file=sys.stderr)
        return 2
    try:
        results = await check_target(executor)
    finally:
        await executor.aclose()
    if as_json:
        print(json.dumps(results, indent=1))
    else:
        for r in results:
            print(f"{'ok ' if r['ok'] else 'FAIL'}  {r['check']:<18} {r['detail']}")
    return 0 if all(r["ok"] for r in results) else 1
