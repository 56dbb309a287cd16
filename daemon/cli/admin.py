"""`obd targets` and `obd pods`: commands that read the config and talk to targets directly."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from daemon.config import Config


def admin_main(args: argparse.Namespace) -> int:
    import anyio

    from daemon.config import ConfigError, load_config
    from daemon.log import configure

    configure("warning")  # log lines go to stderr, so --json output stays clean

    try:
        config = load_config(Path(args.config) if args.config else None)
    except ConfigError as exc:
        print(f"obd: {exc}", file=sys.stderr)
        return 2
    if args.cmd == "targets":
        return anyio.run(_check, config, args.name, args.json)
    from daemon.cli.pods import pods_main

    return pods_main(list(getattr(args, "unknown", [])) + args.rest, config)


async def _check(config: Config, name: str, as_json: bool) -> int:
    """`obd targets check NAME`: the checks of executors/check.py against the target's executor."""
    from daemon.config import ConfigError
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
