"""The demo: a real obd daemon supervising a real (tiny) LoRA fine-tune on this machine.

Runs the `obd` command exactly as a user would, in a throwaway state directory, and shows
each command and its output.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
OBD = [sys.executable, "-m", "daemon.cli"]
WORKLOAD = ["python", "workloads/train_qwen_lora.py", "--tiny"]


def say(text: str) -> None:
    print(f"\n\033[1m## {text}\033[0m", flush=True)


def obd(*args: str, check: bool = True, show: bool = True) -> subprocess.CompletedProcess[str]:
    if show:
        print(f"$ obd {shlex.join(args)}", flush=True)
    out = subprocess.run([*OBD, *args], capture_output=True, text=True, cwd=REPO, env=os.environ)
    if show and out.stdout.strip():
        print(out.stdout.rstrip(), flush=True)
    if out.stderr.strip():
        print(out.stderr.rstrip(), file=sys.stderr, flush=True)
    if check and out.returncode != 0:
        raise SystemExit(f"demo: `obd {shlex.join(args)}` exited {out.returncode}")
    return out


def wait_ready(daemon: subprocess.Popen[bytes], timeout: float = 30) -> None:
    """Wait quietly until the daemon answers on its socket (it is still starting meanwhile)."""
    from daemon.cli.client import Client, DaemonUnreachable

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if daemon.poll() is not None:
            raise SystemExit(f"demo: the daemon exited ({daemon.returncode}); see its log")
        try:
            Client(Path(os.environ["OBD_SOCKET"]), timeout=2).call("ping")
            return
        except DaemonUnreachable:
            time.sleep(0.05)
    raise SystemExit("demo: the daemon did not answer within 30 s; see its log")


def record(run_id: str) -> dict:
    return json.loads(obd("train", "status", run_id, "--json", show=False).stdout)


def wait_step(run_id: str, step: int, timeout: float = 300) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        r = record(run_id)
        if r["state"] not in ("preparing", "running"):
            raise SystemExit(f"demo: run {run_id} ended early: {r['message']}")
        if r["snapshots"] and (r["progress"]["step"] or 0) >= step:
            return r
        time.sleep(0.3)
    raise SystemExit(f"demo: run {run_id} did not reach step {step}")


@contextlib.contextmanager
def demo_daemon() -> Iterator[Path]:
    """A daemon in a throwaway directory under /tmp, for the demo's life; whatever happens (a failure,
    Ctrl-C), nothing is left behind: runs still going are cancelled, the daemon ends, any job left
    is KILLed, and the directory is removed (the daemon's log tail is shown first on a failure)."""
    root = Path(tempfile.mkdtemp(prefix="obd-demo-"))
    saved = dict(os.environ)
    os.environ.update(
        OBD_STATE_DIR=str(root / "state"),
        OBD_SOCKET=str(root / "obd.sock"),
        OBD_CONFIG=str(root / "config.toml"),
        PYTHONPATH=str(REPO),
        PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}",
    )
    daemon: subprocess.Popen[bytes] | None = None
    ok = False
    try:
        (root / "config.toml").write_text('[daemon]\npoll_interval = "0.5s"\n\n[stop]\ncancel_grace = "5s"\n')
        say(f"starting the daemon (state in {root}, removed at the end)")
        with open(root / "daemon.log", "wb") as log:  # the daemon keeps its own copy
            daemon = subprocess.Popen([*OBD, "daemon"], stdout=log, stderr=log, cwd=REPO)
        wait_ready(daemon)
        yield root
        ok = True
    finally:
        if daemon is not None:
            _end(daemon, root)
        if not ok:
            with contextlib.suppress(OSError):
                tail = (root / "daemon.log").read_bytes()[-3000:].decode("utf-8", "replace")
                print(f"demo: the daemon's log ended with:\n{tail}", file=sys.stderr)
        shutil.rmtree(root, ignore_errors=True)
        os.environ.clear()
        os.environ.update(saved)


def _end(daemon: subprocess.Popen[bytes], root: Path) -> None:
    """Cancel the runs still going (the daemon ends their jobs), stop the daemon, KILL any job left."""
    if daemon.poll() is None:
        with contextlib.suppress(Exception):
            listed = subprocess.run(
                [*OBD, "train", "list", "--json"], capture_output=True, text=True, cwd=REPO, timeout=30
            )
            for run in json.loads(listed.stdout):
                if run["state"] in ("queued", "preparing", "running"):
                    subprocess.run(
                        [*OBD, "train", "cancel", run["id"], "--wait"], capture_output=True, cwd=REPO, timeout=60
                    )
        daemon.terminate()
        try:
            daemon.wait(20)
        except subprocess.TimeoutExpired:
            daemon.kill()
            daemon.wait()
    from trainer_plugin.tools import jobctl

    for pidfile in (root / "state").glob("jobs/*/job.pid"):
        handle = jobctl.read_handle(str(pidfile.parent))
        if handle and (jobctl.handle_alive(handle) or jobctl.group_alive(handle)):
            with contextlib.suppress(OSError):
                os.killpg(int(handle["pid"]), signal.SIGKILL)


def main() -> int:
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a `kill` cleans up as Ctrl-C does
    with demo_daemon():
        say("a tiny Qwen2 LoRA fine-tune (random weights, local tokenizer, shipped data)")
        # Long enough that the stop comes while it trains: a tiny step takes ~15 ms on a quiet machine,
        # so 60 steps could be over before the daemon has seen step 5 (step logs come once a second).
        run = obd("train", "start", "--name", "lora-demo", "--", *WORKLOAD, "--max_steps", "2000").stdout.strip()
        wait_step(run, 5)
        obd("train", "status", run)
        say("a snapshot: save at the end of the current step, prove it, stop")
        obd("train", "stop", run, "--wait")
        snap = record(run)["snapshot"]
        ckpt = Path(record(run)["remote_dir"]) / snap["checkpoint"]
        print(f"checkpoint on disk: {ckpt}: {sorted(p.name for p in ckpt.iterdir())}")
        say("resume from the snapshot and let it finish")
        resumed = obd(
            "train",
            "start",
            "--name",
            "lora-resumed",
            "--resume-from",
            run,
            "--",
            *WORKLOAD,
            "--max_steps",
            str(snap["step"] + 10),
        ).stdout.strip()
        obd("train", "logs", resumed, "--follow", show=False)
        print(f"$ obd train logs {resumed} --follow   # (last lines)")
        print("\n".join(obd("train", "logs", resumed, "--tail", "4", show=False).stdout.splitlines()))
        obd("train", "status", resumed)
        say("a second job, cancelled")
        other = obd("train", "start", "--name", "to-cancel", "--", "sh", "-c", "echo working; sleep 600").stdout.strip()
        time.sleep(1)
        obd("train", "cancel", other, "--wait")
        say("the runs")
        obd("train", "list")
        states = {r["name"]: r["state"] for r in json.loads(obd("train", "list", "--json", show=False).stdout)}
        expected = {"lora-demo": "stopped", "lora-resumed": "succeeded", "to-cancel": "cancelled"}
        if states != expected:
            print(f"demo: unexpected states {states}", file=sys.stderr)
            return 1
        print("\ndemo: ok")
        return 0


if __name__ == "__main__":
    sys.exit(main())
