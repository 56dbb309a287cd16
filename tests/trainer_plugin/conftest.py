"""Fixtures for the in-job plugin: a run directory laid out like obd lays it out, and jobs run as real processes."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPTS = Path(__file__).resolve().parent / "scripts"
WORKLOAD = REPO / "workloads" / "train_qwen_lora.py"
PY = sys.executable
JOB_TIMEOUT = 180


def torchrun(logs: Path, ranks: int = 2) -> list[str]:
    """`python -m torch.distributed.run` for `ranks` ranks on this machine, its agent's logs in
    `logs/torchrun` (not a /tmp/torchelastic_* left behind); the script and its arguments follow."""
    launch = [PY, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}"]
    return [*launch, f"--log-dir={logs / 'torchrun'}"]


def install_plugin(plugin: Path) -> Path:
    """What obd does: the trainer_plugin package into plugin/trainer_plugin/, its sitecustomize.py also into plugin/."""
    source = REPO / "trainer_plugin"
    for path in source.rglob("*.py"):
        rel = path.relative_to(source)
        if "__pycache__" not in rel.parts:
            (plugin / "trainer_plugin" / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, plugin / "trainer_plugin" / rel)
    shutil.copy2(source / "plugin" / "sitecustomize.py", plugin / "sitecustomize.py")
    return plugin


def clean_environ() -> dict[str, str]:
    """This process's environment without any OBD_* variable or PYTHONPATH (the test sets those)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("OBD_") and k != "PYTHONPATH"}
    env["TOKENIZERS_PARALLELISM"] = "false"
    env["OMP_NUM_THREADS"] = "1"  # two ranks on two cores must not fight over threads
    return env


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


class RunDir:
    """One run directory: `plugin/`, `output/`, the snapshot files, and the job's environment under obd."""

    def __init__(self, root: Path, run_id: str = "run-test") -> None:
        self.root = root
        self.run_id = run_id
        root.mkdir(parents=True, exist_ok=True)
        self.plugin = install_plugin(root / "plugin")
        self.output = root / "output"
        self.request = root / "snapshot.request"
        self.proof_path = root / "snapshot.json"
        self.metrics_path = root / "metrics.jsonl"
        self.log = root / "job.log"

    def env(self, resume_from: Path | None = None, on_sigterm: bool = False, obd: bool = True) -> dict[str, str]:
        env = clean_environ()
        env["PYTHONPATH"] = str(self.plugin)
        if not obd:
            return env
        env.update(
            OBD_RUN_ID=self.run_id,
            OBD_RUN_DIR=str(self.root),
            OBD_OUTPUT_DIR=str(self.output),
            OBD_SNAPSHOT_REQUEST=str(self.request),
            OBD_SNAPSHOT_FILE=str(self.proof_path),
            OBD_METRICS_FILE=str(self.metrics_path),
        )
        if resume_from is not None:
            env["OBD_RESUME_FROM"] = str(resume_from)
        if on_sigterm:
            env["OBD_SNAPSHOT_ON_SIGTERM"] = "1"
        return env

    def metrics(self) -> list[dict[str, Any]]:
        return read_jsonl(self.metrics_path)

    def proof(self) -> dict[str, Any] | None:
        return json.loads(self.proof_path.read_text()) if self.proof_path.exists() else None

    def logs(self) -> list[dict[str, Any]]:
        return [m for m in self.metrics() if m["event"] == "log"]

    def last_step(self) -> int:
        steps = [m["step"] for m in self.logs()]
        return max(steps) if steps else 0


class Job:
    """A training process started in a run directory, its output going to job.log like under obd."""

    def __init__(self, run: RunDir, argv: list[str], env: dict[str, str], cwd: Path) -> None:
        self.run = run
        self._log = open(run.log, "ab")  # open for the job's whole life, closed in wait()
        self.proc = subprocess.Popen(argv, env=env, cwd=cwd, stdout=self._log, stderr=subprocess.STDOUT)

    def wait(self, timeout: float = JOB_TIMEOUT) -> int:
        try:
            code = self.proc.wait(timeout)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()
            self._log.close()
        return code

    def log_text(self) -> str:
        return self.run.log.read_text(errors="replace")


def wait_until(predicate: Callable[[], Any], job: Job, timeout: float = JOB_TIMEOUT, what: str = "") -> Any:
    """Poll `predicate` every 10 ms while the job runs; fail with its log if the job ends first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        if job.proc.poll() is not None:
            raise AssertionError(f"the job exited ({job.proc.returncode}) before {what}:\n{job.log_text()[-4000:]}")
        time.sleep(0.01)
    raise AssertionError(f"timed out waiting for {what}:\n{job.log_text()[-4000:]}")


@pytest.fixture
def run_dir(tmp_path: Path) -> RunDir:
    return RunDir(tmp_path / "run")


@pytest.fixture
def start_job(tmp_path: Path) -> Iterator[Callable[..., Job]]:
    """Start a job (argv) in a run directory with `env`; its cwd is a scratch directory, never the repo."""
    jobs: list[Job] = []
    cwd = tmp_path / "cwd"
    cwd.mkdir(exist_ok=True)

    def start(run: RunDir, argv: list[str], env: dict[str, str]) -> Job:
        job = Job(run, argv, env, cwd)
        jobs.append(job)
        return job

    yield start
    for job in jobs:
        if job.proc.poll() is None:
            job.proc.kill()
            job.proc.wait()


def assert_exit_zero(job: Job, code: int) -> None:
    assert code == 0, f"exit {code}:\n{job.log_text()[-4000:]}"
