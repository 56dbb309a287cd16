"""The demo: a real obd daemon supervising a real (tiny) LoRA fine-tune on this machine.

Runs the `obd` command exactly as a user would, in a throwaway state directory, and shows
each command and its output.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
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


def main() -> int:
    root = Path(tempfile.mkdtemp(prefix="obd-demo-"))
    os.environ.update(
        OBD_STATE_DIR=str(root / "state"),
        OBD_SOCKET=str(root / "obd.sock"),
        OBD_CONFIG=str(root / "config.toml"),
        PYTHONPATH=str(REPO),
        PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}",
    )
    (root / "config.toml").write_text('[daemon]\npoll_interval = "0.5s"\n\n[stop]\ncancel_grace = "5s"\n')
    say(f"starting the daemon (state in {root})")
    log = open(root / "daemon.log", "wb")  # noqa: SIM115 - the daemon writes to it for the demo's whole life
    daemon = subprocess.Popen([*OBD, "daemon"], stdout=log, stderr=log, cwd=REPO)
    try:
        wait_ready(daemon)
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
    finally:
        daemon.terminate()
        daemon.wait(20)


if __name__ == "__main__":
    sys.exit(main())
