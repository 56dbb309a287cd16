"""Runners: how a `WorkloadConfig` becomes `RunMetrics`, by measuring it or by looking it up.

`LiveRunner` runs the workload script under the profiling wrapper on this machine and parses
what it left; a failed run raises `RunnerFailed` (logs kept), never turns into canned numbers.
`FakeRunner` returns the canned metrics of the synthetic scenario in `workloads/synthetic/`
whose `match` fits the config most specifically, marked `runner_kind: "fake"` everywhere. The
fake is used only when a caller asks for it by name (`get_runner("fake")`).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Literal, Protocol, runtime_checkable

from pydantic import BaseModel, Field, ValidationError

from runner import TARGET_FILES, wrap_command
from runner.assemble import parse_run
from runner.cache import BenchmarkCache, cache_key
from runner.metrics import RunMetrics
from runner.workload import WorkloadConfig
from trainer_plugin import rundir

REPO_ROOT = Path(__file__).resolve().parent.parent
WRAP_SCRIPT = Path(__file__).resolve().parent / "wrap.py"
SCENARIOS_DIR = REPO_ROOT / "workloads" / "synthetic"
PLUGIN_SRC = REPO_ROOT / "trainer_plugin"


def stage_plugin(plugin_dir: Path) -> Path:
    """Lay out `plugin_dir` as the daemon lays out a run's `plugin/` (daemon.service `_plugin_stage`).

    The `trainer_plugin` package goes into `plugin_dir/trainer_plugin/` as it is (`plugin/`,
    `tools/`, `rundir.py`), its `plugin/sitecustomize.py` also to the top, and `TARGET_FILES` (the
    wrapper) to the top. With `plugin_dir` first on PYTHONPATH the job imports the plugin as the
    `trainer_plugin` package only: its modules (`runtime`, `dist`, `loop`, ...) never become
    top-level names that could shadow the job's own packages.
    """
    package = plugin_dir / "trainer_plugin"
    for source in sorted(PLUGIN_SRC.rglob("*.py")):
        rel = source.relative_to(PLUGIN_SRC)
        if "__pycache__" in rel.parts:
            continue
        (package / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(source, package / rel)
    shutil.copy2(PLUGIN_SRC / "plugin" / "sitecustomize.py", plugin_dir / "sitecustomize.py")
    for source in TARGET_FILES:
        shutil.copy2(source, plugin_dir / Path(source).name)
    return plugin_dir


class RunnerFailed(RuntimeError):
    """A live run did not produce metrics; the message says why and where its logs are."""


class NoScenario(LookupError):
    """No synthetic scenario matches the workload."""


@runtime_checkable
class Runner(Protocol):
    """Produces the RunMetrics of a workload run for `steps` steps."""

    kind: Literal["live", "fake"]

    def run(self, config: WorkloadConfig, steps: int) -> RunMetrics: ...


def default_command(config: WorkloadConfig, steps: int, python: str) -> list[str]:
    """The command line of `workloads/train_qwen_lora.py` for `config`.

    Settings that script has no flag for must stay at their defaults: benchmarking something
    other than the config would file a wrong result under the config's cache key. Other scripts
    get a `command_builder` of their own.
    """
    unsupported = {
        name: getattr(config, name) for name, default in _SCRIPT_FIXED.items() if getattr(config, name) != default
    }
    if unsupported:
        raise ValueError(f"{config.script} has no flag for {unsupported}; give LiveRunner a command_builder")
    argv = [
        python,
        str(REPO_ROOT / config.script),
        "--model",
        config.model,
        "--max_steps",
        str(steps),
        "--seq_len",
        str(config.seq_len),
        "--batch_size",
        str(config.batch_size),
        "--precision",
        config.precision,
        "--output_dir",
        rundir.OUTPUT,  # relative: the workload runs in its run directory
    ]
    if config.lora_r is not None:
        argv += ["--lora_rank", str(config.lora_r)]
    return argv + list(config.args)


# WorkloadConfig fields train_qwen_lora.py cannot change, with the value it always runs with.
_SCRIPT_FIXED = {
    "method": "lora",
    "attention": "sdpa",
    "grad_accum": 1,
    "gradient_checkpointing": False,
    "dataloader_workers": 0,
    "num_gpus": 1,
}


@dataclass
class LiveRunner:
    """Run the workload here, under `wrap.py`, and parse the run directory it leaves."""

    work_dir: Path
    cache: BenchmarkCache | None = None
    rocm_image: str = field(default_factory=lambda: os.environ.get("OBD_ROCM_IMAGE", "none"))
    python: str = sys.executable
    timeout_s: float = 3600.0
    kill_grace_s: float = 10.0  # on a timeout: from TERM to the workload's process group to KILL
    command_builder: Callable[[WorkloadConfig, int, str], list[str]] = default_command
    kind: Literal["live", "fake"] = "live"

    def run(self, config: WorkloadConfig, steps: int) -> RunMetrics:
        key = cache_key(config, steps, self.rocm_image, REPO_ROOT / config.script, WRAP_SCRIPT, PLUGIN_SRC)
        if self.cache is not None and (hit := self.cache.get(key)) is not None:
            hit.sources["cache"] = f"benchmark cache {self.cache.path(key).name} (measured earlier, same inputs)"
            return hit
        command = self.command_builder(config, steps, self.python)
        run_dir = Path(self.work_dir) / f"{key.digest[:12]}-{int(time.time())}"
        paths = rundir.RunPaths(run_dir)
        Path(paths.output).mkdir(parents=True, exist_ok=True)
        # The run's plugin/, as obd gives a job on a target: the wrapper runs from there too.
        plugin_dir = stage_plugin(Path(paths.plugin))
        wrapped = wrap_command(command, str(plugin_dir), str(run_dir), python=self.python)
        env = dict(os.environ)
        env.update(
            OBD_RUN_DIR=str(run_dir),
            OBD_OUTPUT_DIR=paths.output,
            OBD_METRICS_FILE=paths.metrics,
            PYTHONPATH=os.pathsep.join(p for p in (str(plugin_dir), env.get("PYTHONPATH", "")) if p),
        )
        log_path = Path(paths.job_log)
        try:
            with open(log_path, "wb") as log:
                returncode = self._run_in_own_group(wrapped, run_dir, env, log)
        except subprocess.TimeoutExpired as exc:
            raise RunnerFailed(f"the workload ran past {self.timeout_s:.0f} s; logs kept in {log_path}") from exc
        except OSError as exc:
            raise RunnerFailed(f"the workload could not start ({exc}); logs kept in {log_path}") from exc
        if returncode != 0:
            raise RunnerFailed(f"the workload exited with status {returncode}; logs kept in {log_path}")
        metrics = parse_run(Path(paths.profile), Path(paths.metrics), workload=config)
        metrics.sources["run_dir"] = str(run_dir)
        if self.cache is not None:
            self.cache.put(key, metrics)
        return metrics

    def _run_in_own_group(self, argv: list[str], run_dir: Path, env: dict[str, str], log: IO[bytes]) -> int:
        """Run the wrapped workload in a session of its own; its exit status, or TimeoutExpired.

        The wrapper starts the training job (under rocprofv3, with an amd-smi sampler beside it)
        and outlives a TERM itself, so killing it alone would leave the job holding the GPU. On a
        timeout, or if this call is interrupted, the whole process group gets TERM, then KILL
        after `kill_grace_s`.
        """
        proc = subprocess.Popen(
            argv,
            cwd=run_dir,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            return proc.wait(timeout=self.timeout_s)
        finally:
            if proc.returncode is None:
                self._kill_group(proc)

    def _kill_group(self, proc: subprocess.Popen) -> None:
        """TERM the workload's process group, give it `kill_grace_s` to go, KILL what is left, reap the wrapper."""
        pgid = proc.pid  # start_new_session: the wrapper leads its own group
        if not _signal_group(pgid, signal.SIGTERM):
            proc.wait()
            return
        deadline = time.monotonic() + self.kill_grace_s
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=self.kill_grace_s)  # the wrapper ends once the job has
        # The group can outlive its leader: wait for the rest of it too, within the grace.
        _wait_group_gone(pgid, deadline)
        if _signal_group(pgid, signal.SIGKILL):
            proc.wait()
            # A killed process is gone a moment later, not at once: wait for that, so the GPU is
            # free when this returns. Bounded, as exited members stay in the group until their
            # new parent reaps them.
            _wait_group_gone(pgid, time.monotonic() + KILL_SETTLE_S)
        proc.wait()


KILL_SETTLE_S = 5.0  # how long to wait for the workload's processes to vanish after SIGKILL


def _wait_group_gone(pgid: int, deadline: float) -> None:
    while _signal_group(pgid, 0) and time.monotonic() < deadline:
        time.sleep(0.02)


def _signal_group(pgid: int, sig: int) -> bool:
    """Send `sig` to the process group; False when the group is gone."""
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # a member we may not signal (setuid): the group is still there
    return True


class Scenario(BaseModel):
    """One canned scenario: `workloads/synthetic/<name>/scenario.json`."""

    name: str
    description: str = ""
    match: dict = Field(default_factory=dict)
    metrics: dict


def load_scenarios(directory: Path = SCENARIOS_DIR) -> list[tuple[Scenario, Path]]:
    """Every valid scenario under `directory`, sorted by name; invalid files raise (they are ours)."""
    found = []
    for path in sorted(Path(directory).glob("*/scenario.json")):
        try:
            scenario = Scenario.model_validate_json(path.read_bytes())
        except (OSError, ValidationError) as exc:
            raise ValueError(f"{path}: invalid scenario: {exc}") from exc
        found.append((scenario, path))
    return found


def choose_scenario(config: WorkloadConfig, scenarios: list[tuple[Scenario, Path]]) -> tuple[Scenario, Path]:
    """The matching scenario with the most `match` keys; ties go to the first name in order."""
    candidates = [(len(s.match), s.name, s, p) for s, p in scenarios if config.matches(s.match)]
    if not candidates:
        raise NoScenario(f"no synthetic scenario matches {config.canonical_json()}")
    candidates.sort(key=lambda c: (-c[0], c[1]))
    return candidates[0][2], candidates[0][3]


@dataclass
class FakeRunner:
    """Canned RunMetrics from a synthetic scenario, always marked fake."""

    scenarios_dir: Path = SCENARIOS_DIR
    kind: Literal["live", "fake"] = "fake"

    def run(self, config: WorkloadConfig, steps: int) -> RunMetrics:
        scenario, path = choose_scenario(config, load_scenarios(self.scenarios_dir))
        data = dict(scenario.metrics)
        data.update(runner_kind="fake", profiler="fake")
        metrics = RunMetrics.model_validate(data)
        where = f"fake: canned scenario {scenario.name!r} ({path.parent.name}/scenario.json), not measured"
        for field_name in (
            "steps",
            "step_time_s",
            "tokens_per_sec",
            "mfu_pct",
            "hbm_peak_gb",
            "hbm_avg_gb",
            "gpu_util_pct",
            "top_kernels",
            "attention_kernel_loaded",
            "waste_budget",
        ):
            metrics.sources[field_name] = where
        metrics.sources["scenario_match"] = json.dumps(scenario.match, sort_keys=True)
        metrics.warnings.insert(
            0,
            f"FAKE: canned numbers of synthetic scenario {scenario.name!r} for a "
            f"{steps}-step request; nothing was measured",
        )
        return metrics


def get_runner(kind: Literal["live", "fake"], **options) -> Runner:
    """The runner of the kind asked for; there is no automatic fallback from one kind to the other."""
    if kind == "live":
        return LiveRunner(**options)
    if kind == "fake":
        return FakeRunner(**options)
    raise ValueError(f"unknown runner kind {kind!r}: 'live' or 'fake'")
