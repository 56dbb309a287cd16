"""Carrying a checkpoint to another target against `scp` of the same bytes (issue 36 item 6).

    python tests/bench/bench_carry.py [--size-mb 1024] [--files 4] [--reps 3] [--json]

A real sshd on loopback (tests/sshd.py) is the other target. A checkpoint of `--files` files of
random bytes, `--size-mb` in all, lies on this machine, as a local run's does. Timed, interleaved
(carry, scp, carry, scp, ...), each into a fresh directory on the "remote" side:

- `carry`: daemon/service/carry.py's `carry_checkpoint`, what `obd train resume --target`/`move` does:
  every file's sha256 here, the upload through the SSH executor (SFTP on its connection), the
  progress count on the destination once a second, and every file's sha256 there before the
  job could start;
- `scp`: `scp -r -q` of the same directory over the same sshd, with the same key (OpenSSH's
  client, the default cipher), and no check at all.

Reported: the median wall time of each and the ratio carry/scp (the goal: at most 1.2), and,
for the carry, what its hashing alone costs (one sha256 pass over the bytes here).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import anyio

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from daemon.service.carry import carry_checkpoint
from daemon.service.models import RunRecord
from executors.ssh import SshExecutor
from tests.executors.ssh.helpers import make_target
from tests.sshd import SshServer


class _Supervision:
    def answers_at_once(self) -> bool:
        return True  # the source is this machine


class _ThisMachine:
    """The source target's executor, as far as a carry asks it: the Python its jobs run."""

    async def python(self) -> str:
        return sys.executable


class _Targets:
    def of(self, record: RunRecord) -> _Supervision:
        return _Supervision()

    def executor(self, record: RunRecord) -> _ThisMachine:
        return _ThisMachine()


class _Store:
    def __init__(self, root: Path) -> None:
        self.root = root

    def run_dir(self, run_id: str) -> Path:
        return self.root / run_id


class _Host:
    """The little of the daemon a carry uses: the source's target is this machine."""

    def __init__(self, root: Path) -> None:
        self.targets = _Targets()
        self.store = _Store(root)

    def touch(self, record: RunRecord) -> None:
        pass


def make_checkpoint(where: Path, size_mb: int, files: int) -> Path:
    checkpoint = where / "output" / "checkpoint-100"
    checkpoint.mkdir(parents=True)
    each = size_mb * (1 << 20) // files
    for i in range(files):
        with open(checkpoint / f"model-{i:05d}-of-{files:05d}.safetensors", "wb") as f:
            left = each
            while left:
                n = min(left, 16 << 20)
                f.write(os.urandom(n))
                left -= n
    (checkpoint / "trainer_state.json").write_text('{"global_step": 100}')
    return checkpoint


def hash_once(checkpoint: Path) -> float:
    began = time.perf_counter()
    for path in sorted(checkpoint.iterdir()):
        h = hashlib.sha256()
        with open(path, "rb") as f:
            while chunk := f.read(1 << 20):
                h.update(chunk)
    return time.perf_counter() - began


async def carry_once(server: SshServer, work: Path, source: RunRecord, dest: str) -> float:
    ex = SshExecutor("box", make_target(server, work / "remote"))
    try:
        await ex.connect()  # the connection is made once per target and kept: not timed
        into = RunRecord(id="20261205-000000-bbbbbb", target="box")
        began = time.perf_counter()
        await carry_checkpoint(_Host(work / "store"), source, "checkpoint-100", ex, dest, work / "stage", into=into)  # type: ignore[arg-type]
        return time.perf_counter() - began
    finally:
        await ex.aclose()


def scp_once(server: SshServer, checkpoint: Path, dest: Path) -> float:
    argv = [
        "scp", "-r", "-q", "-P", str(server.port), "-i", str(server.identity_file),
        "-o", f"UserKnownHostsFile={server.known_hosts}", "-o", "StrictHostKeyChecking=yes",
        "-o", "BatchMode=yes", str(checkpoint), f"{server.user}@{server.host}:{dest}",
    ]  # fmt: skip
    began = time.perf_counter()
    subprocess.run(argv, check=True)
    return time.perf_counter() - began


def measure(size_mb: int, files: int, reps: int) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix="obd-bench-carry-", dir="/tmp"))
    try:
        with SshServer(work / "sshd") as server:
            checkpoint = make_checkpoint(work / "run", size_mb, files)
            source = RunRecord(id="20261205-000000-aaaaaa", target="local", remote_dir=str(work / "run"))
            (work / "remote").mkdir()
            carry, scp = [], []
            for i in range(reps):
                dest = work / "remote" / f"carried-{i}"
                carry.append(anyio.run(carry_once, server, work, source, str(dest / "checkpoint-100")))
                shutil.rmtree(dest)
                copied = work / "remote" / f"scp-{i}"
                copied.mkdir()
                scp.append(scp_once(server, checkpoint, copied))
                shutil.rmtree(copied)
            hashing = hash_once(checkpoint)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return {
        "size_mb": size_mb,
        "files": files,
        "carry_s": statistics.median(carry),
        "scp_s": statistics.median(scp),
        "ratio": statistics.median(carry) / statistics.median(scp),
        "carry_runs": carry,
        "scp_runs": scp,
        "hash_once_s": hashing,
    }


def report(r: dict[str, Any]) -> str:
    return (
        f"a checkpoint of {r['size_mb']} MB in {r['files']} files, this machine -> an SSH target on loopback "
        f"(median of {len(r['carry_runs'])}, interleaved):\n"
        f"  obd's carry (sha256 here, SFTP, sha256 there) {r['carry_s']:.2f} s "
        f"({r['size_mb'] / r['carry_s']:.0f} MB/s)\n"
        f"  scp -r of the same bytes                      {r['scp_s']:.2f} s ({r['size_mb'] / r['scp_s']:.0f} MB/s)\n"
        f"  carry / scp: {r['ratio']:.2f}   (one sha256 pass over the bytes here: {r['hash_once_s']:.2f} s)"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-mb", type=int, default=1024)
    parser.add_argument("--files", type=int, default=4)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    result = measure(args.size_mb, args.files, args.reps)
    print(json.dumps(result) if args.json else report(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
