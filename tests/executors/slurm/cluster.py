"""A real Slurm cluster on this machine for tests: munge, slurmctld and two slurmd (n1, n2).

Every daemon runs in the foreground under a temporary directory, with free ports and a munge
socket of its own, so nothing of the machine's own Slurm or munge (if any) is touched. The
directory and the socket's are open to every user (not the key, nor the state), as /etc/slurm
and /run/munge are: a root daemon submits a user's job as that user, whose sbatch reads
slurm.conf and asks munge for a credential. Node names do
not resolve, so each node's `NodeAddr` is 127.0.0.1 and its `Port=` its own. `SLURM_CONF`
points the client commands (sbatch, squeue, ...) at this cluster.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

NODES = ("n1", "n2")
CPUS_PER_NODE = 4  # declared (config_overrides): more than the machine may have, so 2-node jobs fit
PARTITION = "debug"
PROGRAMS = ("munged", "mungekey", "slurmctld", "slurmd", "sbatch", "squeue", "scancel", "scontrol", "sinfo", "srun")


def missing_reason() -> str | None:
    """Why a cluster cannot be brought up here, or None when it can."""
    if os.geteuid() != 0:
        return "the Slurm tests need root (slurmd runs jobs as their users); CI runs as root"
    missing = [p for p in PROGRAMS if shutil.which(p) is None and not Path("/usr/sbin", p).exists()]
    if missing:
        return (
            f"Slurm is not installed ({', '.join(missing)} missing): run `sudo bash scripts/setup_slurm.sh` "
            "(Debian's slurmctld, slurmd, slurm-client and munge)"
        )
    return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _program(name: str) -> str:
    return shutil.which(name) or str(Path("/usr/sbin", name))


@dataclass
class Cluster:
    """A running test cluster: where its files are and how to reach it."""

    root: Path
    conf: Path
    munge_socket: Path
    ctld_port: int
    node_ports: dict[str, int]
    settings: dict[str, str] = field(default_factory=dict)
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)

    @property
    def env(self) -> dict[str, str]:
        """What a client of this cluster needs in its environment."""
        return {"SLURM_CONF": str(self.conf)}

    def run(self, *argv: str, check: bool = True, timeout: float = 30) -> subprocess.CompletedProcess[str]:
        """A Slurm client command against this cluster."""
        out = subprocess.run(
            list(argv), env={**os.environ, **self.env}, capture_output=True, text=True, timeout=timeout, check=False
        )
        if check and out.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)} failed ({out.returncode}): {out.stderr.strip()}")
        return out

    def log(self, name: str) -> str:
        path = self.root / "log" / f"{name}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    # --- daemons ---------------------------------------------------------------------------

    def _spawn(self, name: str, argv: list[str]) -> None:
        log = open(self.root / "log" / f"{name}.out", "ab")
        self.procs[name] = subprocess.Popen(
            argv,
            env={**os.environ, **self.env},
            stdout=log,
            stderr=log,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        log.close()

    def start_munge(self) -> None:
        key = self.root / "munge" / "munge.key"
        subprocess.run([_program("mungekey"), "--create", f"--keyfile={key}"], check=True, capture_output=True)
        key.chmod(0o600)
        self._spawn(
            "munged",
            [
                _program("munged"),
                "--foreground",
                "--force",
                f"--socket={self.munge_socket}",
                f"--key-file={key}",
                f"--log-file={self.root / 'log' / 'munged.log'}",
                f"--pid-file={self.root / 'munge' / 'munged.pid'}",
                f"--seed-file={self.root / 'munge' / 'munged.seed'}",
            ],
        )
        _wait(self.munge_socket.exists, 10, "munged's socket", self)

    def start_ctld(self) -> None:
        self._spawn("slurmctld", [_program("slurmctld"), "-D", "-f", str(self.conf)])
        _wait(
            lambda: self.run("scontrol", "ping", check=False, timeout=5).stdout.count("UP") > 0, 20, "slurmctld", self
        )

    def start_node(self, node: str) -> None:
        self._spawn(f"slurmd-{node}", [_program("slurmd"), "-D", "-N", node, "-f", str(self.conf)])

    def start(self) -> None:
        self.start_munge()
        self.start_ctld()
        for node in NODES:
            self.start_node(node)
        self.wait_nodes_idle()

    def wait_nodes_idle(self, timeout: float = 30) -> None:
        def idle() -> bool:
            out = self.run("sinfo", "-h", "-N", "-o", "%N %t", check=False, timeout=5).stdout.split()
            states = dict(zip(out[::2], out[1::2], strict=False))
            return all(states.get(n, "").startswith(("idle", "mix", "alloc")) for n in NODES)

        _wait(idle, timeout, "both nodes to be idle", self)

    def restart_ctld(self) -> None:
        """Stop slurmctld (jobs keep running on the nodes) and start it again from its saved state."""
        proc = self.procs.pop("slurmctld")
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
        self.start_ctld()

    def jobs(self) -> list[dict[str, str]]:
        """Every job slurmctld still knows (`squeue -t all`): id, name, state."""
        out = self.run("squeue", "-h", "-t", "all", "-o", "%i|%j|%T|%N").stdout
        return [dict(zip(("id", "name", "state", "nodes"), line.split("|"), strict=False)) for line in out.splitlines()]

    def stepds(self) -> list[int]:
        """Pids of slurmstepd processes of this cluster (a job's steps still being torn down)."""
        pids = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            with contextlib.suppress(OSError):
                cmdline = (entry / "cmdline").read_bytes()
                if cmdline.startswith(b"slurmstepd") and str(self.root).encode() in (entry / "environ").read_bytes():
                    pids.append(int(entry.name))
        return pids

    def stop(self) -> None:
        """Cancel what is left, wait for the steps to go, then shut the daemons down."""
        if "slurmctld" in self.procs and self.procs["slurmctld"].poll() is None:
            self.run("scancel", "--full", "--user=root", check=False, timeout=10)
            with contextlib.suppress(AssertionError):
                _wait(lambda: not self.stepds(), 30, "slurmstepd to end", self)
            self.run("scontrol", "shutdown", check=False, timeout=10)
        for name, proc in reversed(list(self.procs.items())):
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(10 if name != "munged" else 0.1)
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        for pid in self.stepds():
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)


def _wait(predicate: Callable[[], object], timeout: float, what: str, cluster: Cluster) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(subprocess.TimeoutExpired, OSError):
            if predicate():
                return
        time.sleep(0.1)
    logs = "\n".join(f"--- {n} ---\n{cluster.log(n)[-1500:]}" for n in ("slurmctld", "slurmd-n1", "slurmd-n2"))
    raise AssertionError(f"timed out after {timeout}s waiting for {what}\n{logs}")


def slurm_conf(root: Path, ctld_port: int, node_ports: dict[str, int], settings: dict[str, str]) -> str:
    lines = {
        "ClusterName": "obdtest",
        "SlurmctldHost": "localhost(127.0.0.1)",
        "SlurmctldPort": str(ctld_port),
        "SlurmUser": "root",
        "SlurmdUser": "root",
        "AuthType": "auth/munge",
        "CredType": "cred/munge",
        "AuthInfo": f"socket={root / 'munge' / 'munge.socket'}",
        "StateSaveLocation": str(root / "state"),
        "SlurmdSpoolDir": str(root / "spool" / "%n"),
        "SlurmctldPidFile": str(root / "run" / "slurmctld.pid"),
        "SlurmdPidFile": str(root / "run" / "slurmd-%n.pid"),
        "SlurmctldLogFile": str(root / "log" / "slurmctld.log"),
        "SlurmdLogFile": str(root / "log" / "slurmd-%n.log"),
        # pgid, not linuxproc: a process that outlives its parent is still found and killed.
        "ProctrackType": "proctrack/pgid",
        "TaskPlugin": "task/none",
        "SwitchType": "switch/none",
        "MpiDefault": "none",
        "SchedulerType": "sched/builtin",
        "SchedulerParameters": "batch_sched_delay=0,sched_min_interval=0",
        "SelectType": "select/cons_tres",
        "SelectTypeParameters": "CR_CPU",
        "SlurmdParameters": "config_overrides",
        "ReturnToService": "2",
        "MinJobAge": "30",
        "KillWait": "5",
        "InactiveLimit": "0",
        "SlurmctldTimeout": "30",
        "SlurmdTimeout": "60",
        "MessageTimeout": "10",
        "JobAcctGatherType": "jobacct_gather/none",
        "AccountingStorageType": "accounting_storage/none",
        "JobCompType": "jobcomp/none",
        "PlugStackConfig": str(root / "plugstack.conf"),
        **settings,
    }
    text = "".join(f"{k}={v}\n" for k, v in lines.items())
    for node, port in node_ports.items():
        text += f"NodeName={node} NodeAddr=127.0.0.1 NodeHostname=localhost Port={port} CPUs={CPUS_PER_NODE} State=UNKNOWN\n"
    text += f"PartitionName={PARTITION} Nodes={','.join(node_ports)} Default=YES MaxTime=INFINITE State=UP\n"
    return text


class SharedCluster:
    """One cluster for the whole test session, however many fixtures ask for it: up on the first
    `acquire`, down when the last holder releases it."""

    def __init__(self) -> None:
        self._holders = 0
        self._context: contextlib.AbstractContextManager[Cluster] | None = None
        self.cluster: Cluster | None = None

    def acquire(self) -> Cluster:
        if self.cluster is None:
            self._context = running_cluster(TEST_SETTINGS)
            self.cluster = self._context.__enter__()
        self._holders += 1
        return self.cluster

    def release(self) -> None:
        self._holders -= 1
        if self._holders == 0 and self._context is not None:
            context, self._context, self.cluster = self._context, None, None
            context.__exit__(None, None, None)


# Short enough for tests: a finished job stays visible 10 s, KILL comes 3 s after TERM.
TEST_SETTINGS = {"MinJobAge": "10", "KillWait": "3"}
SHARED = SharedCluster()


@contextlib.contextmanager
def running_cluster(settings: dict[str, str] | None = None) -> Iterator[Cluster]:
    """A cluster up for the duration of the block, torn down (every daemon and step) after it."""
    root = Path(tempfile.mkdtemp(prefix="obd-slurm-", dir="/tmp"))
    root.chmod(0o755)  # users' Slurm commands read slurm.conf here
    for sub in ("munge", "state", "spool", "run", "log"):
        (root / sub).mkdir()
    (root / "munge").chmod(0o711)  # the socket reachable by users (munged's own check allows it), the key not
    (root / "plugstack.conf").write_text("")
    ports = {n: free_port() for n in NODES}
    ctld_port = free_port()
    conf = root / "slurm.conf"
    conf.write_text(slurm_conf(root, ctld_port, ports, settings or {}))
    cluster = Cluster(root, conf, root / "munge" / "munge.socket", ctld_port, ports, settings or {})
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()
        shutil.rmtree(root, ignore_errors=True)


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


if __name__ == "__main__":  # bring one up by hand: python -m tests.executors.slurm.cluster (TERM or ^C ends it)
    signal.signal(signal.SIGTERM, _interrupt)
    with running_cluster() as c:
        print(f"export SLURM_CONF={c.conf}", flush=True)
        with contextlib.suppress(KeyboardInterrupt):
            signal.pause()
