"""What a command costs beyond the interpreter, and what a remote target adds to the daemon's start
(issue 34 items 25 and 26); prints ratios and differences measured side by side.

    python tests/bench/bench_client_imports.py [--tree DIR] [--runs 1000] [--pairs 40] [--starts 8]

`--tree` is a source tree to measure (default: this checkout; `git archive COMMIT daemon executors
trainer_plugin runner obd.py | tar -x -C DIR` gives an older one). The tree is copied into a
temporary directory and compiled, as an install would leave it (pip writes the .pyc files), so
neither this checkout's state nor PYTHONDONTWRITEBYTECODE changes the figures.

- `obd train list --all --json` against a daemon holding `--runs` records, run as the console
  script pip writes, by a bare venv of this interpreter's base Python (obd installed into it, as the
  README's system-Python install does, not editable), paired with a bare `python -c pass` of the
  same venv, interleaved: the median of the pairs' ratios, and the median times. The client finds
  the socket as a user's does (no OBD_SOCKET: the config file looked for, then STATE_DIR/obd.sock).
  Two console scripts: the one pip 25 and later (and uv) write, and the one older pip wrote
  (distlib's template, which imports `re` for its own first line: ~20 modules the client never
  needs), timed in the same rounds.
- The daemon's start to a socket that answers (a ping), with only `local`, with a Runpod target (a
  loopback fake of the API), an SSH target (a host that refuses) and a Slurm target (no cluster):
  interleaved starts, the median of each and what each remote kind adds.
"""

from __future__ import annotations

import argparse
import compileall
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import venv
from collections.abc import Callable
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from daemon.cli.client import Client, DaemonUnreachable
from daemon.service.models import RunRecord, RunState
from daemon.service.store import RunStore
from tests.fakes.runpod_api import FakeRunpod

PACKAGES = ("daemon", "executors", "trainer_plugin", "runner")
CONFIG = '[daemon]\npoll_interval = "1s"\nremote_poll_interval = "1s"\n'
# pip's console script, as pip 25 and later write it for `obd = "daemon.cli:main"` (its
# PipScriptMaker: no `re`, for the start's sake), and as older pip wrote it (distlib's template).
CONSOLE_SCRIPT = """#!{python}
import sys
from daemon.cli import main
if __name__ == '__main__':
    sys.argv[0] = sys.argv[0].removesuffix('.exe')
    sys.exit(main())
"""
OLD_PIP_SCRIPT = """#!{python}
# -*- coding: utf-8 -*-
import re
import sys
from daemon.cli import main
if __name__ == "__main__":
    sys.argv[0] = re.sub(r"(-script\\.pyw|\\.exe)?$", "", sys.argv[0])
    sys.exit(main())
"""


def installed_tree(tree: Path, into: Path) -> Path:
    """A compiled copy of the tree's packages (what an install leaves in site-packages)."""
    into.mkdir(parents=True)
    for name in PACKAGES:
        shutil.copytree(tree / name, into / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    if (tree / "obd.py").exists():
        shutil.copy(tree / "obd.py", into / "obd.py")
    compileall.compile_dir(into, quiet=1)
    return into


def bare_venv(path: Path, site: Path) -> Path:
    """A venv of the base interpreter (no pip, no editable finder), with `site` on its path and an
    `obd` console script; returns the script."""
    venv.EnvBuilder(with_pip=False, symlinks=True).create(path)
    python = path / "bin" / "python"
    found = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], capture_output=True, text=True
    )
    Path(found.stdout.strip(), "obd-bench.pth").write_text(f"{site}\n")
    for name, template in (("obd", CONSOLE_SCRIPT), ("obd-old-pip", OLD_PIP_SCRIPT)):
        (path / "bin" / name).write_text(template.format(python=python))
        (path / "bin" / name).chmod(0o755)
    return path / "bin" / "obd"


def fill_store(state_dir: Path, runs: int) -> None:
    store = RunStore(state_dir)
    for i in range(runs):
        r = RunRecord(id=f"20260101-000000-{i:06x}", command=["python", "train.py", f"--seed={i}"], name=f"run{i}")
        for state, why in (
            (RunState.preparing, "created"),
            (RunState.running, "started"),
            (RunState.succeeded, "exit 0"),
        ):
            r.transition(state, why)
        store.save(r)


class Daemon:
    """One daemon of the copied tree (this interpreter, with its dependencies), in `root`."""

    def __init__(self, root: Path, site: Path, config: str, env: dict[str, str] | None = None) -> None:
        root.mkdir(parents=True, exist_ok=True)
        self.root, self.site, self.socket = root, site, root / "obd.sock"
        (root / "config.toml").write_text(config)
        self.env = {
            **{k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "COLUMNS", "LINES")},
            "OBD_STATE_DIR": str(root / "state"),
            "OBD_SOCKET": str(self.socket),
            "OBD_CONFIG": str(root / "config.toml"),
            "OBD_NO_SCOPE": "1",
            "PYTHONPATH": str(site),
            **(env or {}),
        }
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> float:
        """Start it; seconds until its socket answered a ping."""
        with open(self.root / "daemon.log", "ab") as log:
            started = time.perf_counter()
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "daemon.cli", "daemon", "--log-level", "warning"],
                env=self.env,
                stdout=log,
                stderr=log,
                cwd=self.site,
            )
            while not self.answers():  # every 2 ms: a coarser wait would round the figure to it
                if self.proc.poll() is not None or time.perf_counter() - started > 60:
                    raise RuntimeError(f"the daemon did not answer: {(self.root / 'daemon.log').read_text()[-2000:]}")
                time.sleep(0.002)
            return time.perf_counter() - started

    def answers(self) -> bool:
        try:
            c = Client(self.socket, timeout=2)
            c.call("ping")
            c.close()
            return True
        except DaemonUnreachable:
            return False

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None


def _wall(argv: list[str], env: dict[str, str]) -> tuple[float, float]:
    """Wall seconds of one process, and the CPU seconds it used (user + system; what a busy
    machine changes least)."""
    started = time.perf_counter()
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    _, status, usage = os.wait4(proc.pid, 0)
    took = time.perf_counter() - started
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise RuntimeError(f"{argv} exited {proc.returncode}")
    return took, usage.ru_utime + usage.ru_stime


def imports(argv: list[str], env: dict[str, str]) -> tuple[dict[str, int], set[str]]:
    """What `-X importtime` says the process imported: its top-level imports (name -> cumulative
    microseconds, what each brought in included), and every module's name."""
    top: dict[str, int] = {}
    names: set[str] = set()
    for line in subprocess.run(argv, env=env, capture_output=True, text=True).stderr.splitlines():
        if not line.startswith("import time:") or "self [us]" in line:
            continue
        _, cumulative, name = line[len("import time:") :].split("|")
        names.add(name.strip())
        if name.startswith(" ") and not name.startswith("  "):
            top[name.strip()] = int(cumulative)
    return top, names


def own_imports(command: list[str], env: dict[str, str]) -> tuple[int, float]:
    """How many modules the command imports that a bare interpreter does not, and the milliseconds
    its own top-level imports took (one run: a busy machine moves this figure the most)."""
    bare_top, bare_names = imports([command[0], "-X", "importtime", "-c", "pass"], env)
    top, names = imports([command[0], "-X", "importtime", *command[1:]], env)
    return len(names - bare_names), sum(v for k, v in top.items() if k not in bare_top) / 1000


def bench_list(work: Path, site: Path, runs: int, pairs: int) -> dict[str, float]:
    """`obd train list --all --json` paired with `python -c pass` of the same bare venv."""
    script = bare_venv(work / "venv", site)
    python = str(script.parent / "python")
    d = Daemon(work / "list", site, CONFIG)
    fill_store(d.root / "state", runs)
    d.start()
    client_state = work / "client-state"
    client_state.mkdir()
    (client_state / "obd.sock").symlink_to(d.socket)
    try:
        env = {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "HOME": os.environ.get("HOME", "/"),
            # The socket found as a user's is, not named: STATE_DIR/obd.sock (a link to the
            # daemon's), after looking for a config file that is absent.
            "OBD_STATE_DIR": str(client_state),
            "OBD_CONFIG": str(work / "no-config.toml"),
            "LANG": "C.UTF-8",
        }
        args = ["train", "list", "--all", "--json"]
        listing = [python, str(script), *args]
        old = [python, str(script.parent / "obd-old-pip"), *args]
        check = subprocess.run(listing, env=env, capture_output=True, text=True)
        assert check.returncode == 0 and check.stdout.count('"id"') == runs, check.stderr
        bare = [python, "-c", "pass"]
        for _ in range(3):  # warm the page cache
            _wall(bare, env), _wall(listing, env), _wall(old, env)
        base, full, ratios, cpu_ratios, old_ratios = [], [], [], [], []
        for i in range(pairs):
            order = [("bare", bare), ("new", listing), ("old", old)]
            got = dict((name, _wall(argv, env)) for name, argv in order[i % 3 :] + order[: i % 3])  # rotated
            b, f = got["bare"], got["new"]
            base.append(b[0])
            full.append(f[0])
            ratios.append(f[0] / b[0])
            cpu_ratios.append(f[1] / b[1] if b[1] else float("nan"))
            old_ratios.append(got["old"][0] / b[0])
        module_count, import_ms = own_imports(listing, env)
        old_count, _ = own_imports(old, env)
    finally:
        d.stop()
    return {
        "ratio_median": statistics.median(ratios),
        "cpu_ratio_median": statistics.median(cpu_ratios),
        "old_pip_ratio_median": statistics.median(old_ratios),
        "list_ms": statistics.median(full) * 1000,
        "bare_ms": statistics.median(base) * 1000,
        "import_ms": import_ms,
        "modules_imported": module_count,
        "old_pip_modules_imported": old_count,
    }


def bench_ready(work: Path, site: Path, starts: int) -> dict[str, float]:
    """The daemon's start to an answering socket: only `local`, + a Runpod target, + an SSH target."""
    fake = FakeRunpod(api_keys=("bench-key",)).start()
    try:
        pods = (
            f'\n[targets.pods]\nkind = "runpod"\ngpu_type = ["NVIDIA GeForce RTX 4090"]\nworkdir = "{work}/pod"\n'
            f'identity_file = "{work}/no-key"\n'
        )
        ssh = f'\n[targets.box]\nkind = "ssh"\nhost = "127.0.0.1"\nport = 9\nworkdir = "{work}/ssh"\nconnect_timeout = 2\n'
        slurm = f'\n[targets.hpc]\nkind = "slurm"\nworkdir = "{work}/hpc"\n'
        kinds: dict[str, Callable[[int], Daemon]] = {
            "local": lambda i: Daemon(work / f"local-{i}", site, CONFIG),
            "runpod": lambda i: Daemon(
                work / f"runpod-{i}",
                site,
                CONFIG + pods,
                {"RUNPOD_API_BASE_URL": fake.url, "RUNPOD_API_KEY": "bench-key"},
            ),
            "ssh": lambda i: Daemon(work / f"ssh-{i}", site, CONFIG + ssh),
            "slurm": lambda i: Daemon(work / f"slurm-{i}", site, CONFIG + slurm),
        }
        took: dict[str, list[float]] = {k: [] for k in kinds}
        for i in range(starts + 1):
            order = list(kinds) if i % 2 else list(reversed(kinds))
            for kind in order:
                d = kinds[kind](i)
                try:
                    seconds = d.start()
                finally:
                    d.stop()
                if i:  # the first round warms the page cache
                    took[kind].append(seconds)
    finally:
        fake.stop()
    medians = {k: statistics.median(v) for k, v in took.items()}
    return {
        "local_s": medians["local"],
        "runpod_s": medians["runpod"],
        "ssh_s": medians["ssh"],
        "runpod_adds_s": medians["runpod"] - medians["local"],
        "ssh_adds_s": medians["ssh"] - medians["local"],
        "slurm_s": medians["slurm"],
        "slurm_adds_s": medians["slurm"] - medians["local"],
    }


def run(tree: Path, runs: int, pairs: int, starts: int) -> dict[str, dict[str, float]]:
    work = Path(tempfile.mkdtemp(prefix="obd-bench-imports-", dir="/tmp"))
    try:
        site = installed_tree(tree, work / "site")
        return {"list": bench_list(work, site, runs, pairs), "ready": bench_ready(work, site, starts)}
    finally:
        shutil.rmtree(work, ignore_errors=True)


def report(result: dict[str, dict[str, float]], runs: int) -> str:
    ls, rd = result["list"], result["ready"]
    return (
        f"obd train list --all --json, {runs} runs, whole process vs bare `python -c pass` (same venv, interleaved): "
        f"ratio {ls['ratio_median']:.2f} (median of pairs; {ls['list_ms']:.1f} ms vs {ls['bare_ms']:.1f} ms; "
        f"the client's own CPU time: ratio {ls['cpu_ratio_median']:.2f}; "
        f"modules imported beyond the bare interpreter's: {ls['modules_imported']:.0f}, in "
        f"{ls['import_ms']:.1f} ms); with older pip's console script (imports `re`): ratio "
        f"{ls['old_pip_ratio_median']:.2f}, {ls['old_pip_modules_imported']:.0f} modules\n"
        f"daemon start to an answering socket: local only {rd['local_s'] * 1000:.0f} ms; with a Runpod target "
        f"{rd['runpod_s'] * 1000:.0f} ms (+{rd['runpod_adds_s'] * 1000:.0f} ms); with an SSH target "
        f"{rd['ssh_s'] * 1000:.0f} ms (+{rd['ssh_adds_s'] * 1000:.0f} ms); with a Slurm target "
        f"{rd['slurm_s'] * 1000:.0f} ms (+{rd['slurm_adds_s'] * 1000:.0f} ms)"
    )


@pytest.mark.bench
def test_bench_client_imports_and_readiness() -> None:
    result = run(REPO, 1000, 30, 5)
    print(report(result, 1000))
    assert result["list"]["ratio_median"] > 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tree", type=Path, default=REPO, help="the source tree to measure (default: this checkout)")
    parser.add_argument("--runs", type=int, default=1000)
    parser.add_argument("--pairs", type=int, default=40)
    parser.add_argument("--starts", type=int, default=8)
    args = parser.parse_args()
    print(report(run(args.tree.resolve(), args.runs, args.pairs, args.starts), args.runs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
