"""`obd targets` and `obd pods`: commands that read the config and talk to targets directly."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


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
    if args.cmd == "targets" and args.action == "list":
        rows = [{"name": "local", "kind": "local"}] if "local" not in config.targets else []
        rows += [{"name": n, "kind": t.kind} for n, t in sorted(config.targets.items())]
        print(json.dumps(rows, indent=1) if args.json else "\n".join(f"{r['name']:20} {r['kind']}" for r in rows))
        return 0
    if args.cmd == "targets":
        return anyio.run(_check, config, args.name, args.json)
    from executors.pods_cli import pods_main

    return pods_main(list(getattr(args, "unknown", [])) + args.rest, config)


async def _check(config, name: str, as_json: bool) -> int:
    from daemon.config import ConfigError, LocalTarget
    from executors.check import check_target
    from executors.local import LocalExecutor

    try:
        target = config.target(name)
    except ConfigError as exc:
        print(f"obd: {exc}", file=sys.stderr)
        return 2
    if isinstance(target, LocalTarget):
        executor = LocalExecutor(name, Path(target.workdir or Path(config.daemon.state_dir) / "jobs"), target.python)
    elif target.kind == "ssh":
        from executors.ssh import SshExecutor

        executor = SshExecutor(name, target)
    else:
        print("obd: `targets check` covers local and ssh targets; for pods use `obd pods list`", file=sys.stderr)
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
