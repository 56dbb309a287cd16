"""What the GPU checks share: finding the devices, the workload's command, a daemon on the real GPUs, and results.

Imported by `tests/gpu/` and `tests/bench/bench_gpu_*.py`; importing it is cheap (no torch, no
subprocess): the device probe runs once, the first time a test asks for it.

Every number a check measures goes through `record()`, with its unit and a sentence saying where
it came from. `record()` prints it and, when `OBD_GPU_RESULTS` names a file, appends it there as
one JSON line; `tests/gpu/summary.py` turns that file into the table `scripts/gpu_check.sh` prints.

`OBD_GPU_CHECK_DRY_RUN=1` runs the checks on the CPU with a tiny model, so the harness itself
can be tried on a machine without a GPU; a check that only means something on a GPU (discovery,
NVML, fused attention) is skipped there, and every recorded number is marked `dry run (CPU)`.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
WORKLOAD = Path(__file__).resolve().parent / "workload.py"
DRY_RUN = os.environ.get("OBD_GPU_CHECK_DRY_RUN") == "1"

# The daemon's timings for the checks: quick polls, and room for a multi-GB checkpoint's proof.
GPU_CONFIG = """
[daemon]
poll_interval = 0.2
remote_poll_interval = 0.5
probe_timeout = 10

[stop]
proof_timeout = "300s"
end_timeout = "120s"
request_poll = 1
cancel_grace = 5
"""

_PROBE_SCRIPT = r"""
import json, sys
out = {"python": sys.version.split()[0]}
try:
    import torch
except Exception as exc:
    out["torch_error"] = f"{type(exc).__name__}: {exc}"
else:
    out["torch"] = torch.__version__
    out["cuda"] = getattr(torch.version, "cuda", None)
    out["hip"] = getattr(torch.version, "hip", None)
    try:
        out["available"] = bool(torch.cuda.is_available())
        out["count"] = torch.cuda.device_count() if out["available"] else 0
        out["names"] = [torch.cuda.get_device_name(i) for i in range(out["count"])]
        out["memory_bytes"] = [torch.cuda.get_device_properties(i).total_memory for i in range(out["count"])]
    except Exception as exc:
        out["cuda_error"] = f"{type(exc).__name__}: {exc}"
for name in ("transformers", "peft"):
    try:
        out[name] = __import__(name).__version__
    except Exception as exc:
        out[name + "_error"] = f"{type(exc).__name__}: {exc}"
print(json.dumps(out))
"""


def training_python() -> str:
    """The Python the jobs train with: `OBD_GPU_PYTHON`, else the one running the tests."""
    return os.environ.get("OBD_GPU_PYTHON") or sys.executable


@dataclass
class Probe:
    """What this machine offers the checks: the vendors' tools, and what torch in the training Python sees."""

    torch: dict[str, Any] = field(default_factory=dict)
    nvidia_smi: str | None = None  # `nvidia-smi -L`, or None when it is missing or fails
    amd_smi: str | None = None  # `amd-smi list`, or None

    @property
    def device_count(self) -> int:
        return int(self.torch.get("count") or 0)

    @property
    def vendor(self) -> str | None:
        if not self.device_count:
            return None
        return "amd" if self.torch.get("hip") else "nvidia"

    def no_device_reason(self) -> str | None:
        """Why there is nothing to check on (None when torch sees a CUDA or ROCm device)."""
        if self.device_count:
            return None
        if "torch" not in self.torch:
            seen = f"torch cannot be imported by {training_python()} ({self.torch.get('torch_error', 'no answer')})"
        else:
            seen = f"torch {self.torch['torch']} in {training_python()} sees no device"
            if self.torch.get("cuda_error"):
                seen += f" ({self.torch['cuda_error']})"
        smi = "nvidia-smi lists none" if self.nvidia_smi is None else "nvidia-smi lists GPUs torch does not see"
        amd = "amd-smi lists none" if self.amd_smi is None else "amd-smi lists GPUs torch does not see"
        return f"no CUDA/ROCm device: {seen}; {smi}; {amd}"

    def describe(self) -> str:
        t = self.torch
        names = ", ".join(t.get("names") or []) or "none"
        return (
            f"python {t.get('python')}, torch {t.get('torch')} (CUDA {t.get('cuda')}, HIP {t.get('hip')}), "
            f"transformers {t.get('transformers')}, peft {t.get('peft')}; devices: {names}"
        )


def _tool_output(argv: list[str], timeout: float = 20) -> str | None:
    """A vendor tool's output when it ran and succeeded; None otherwise."""
    if shutil.which(argv[0]) is None:
        return None
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout if done.returncode == 0 and done.stdout.strip() else None


@functools.cache
def probe() -> Probe:
    """Ask the vendors' tools and the training Python's torch what devices there are (once per process)."""
    try:
        done = subprocess.run(
            [training_python(), "-c", _PROBE_SCRIPT], capture_output=True, text=True, timeout=180, check=False
        )
        lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
        torch_info = json.loads(lines[-1]) if lines else {"torch_error": done.stderr.strip()[-300:] or "no output"}
    except (OSError, subprocess.TimeoutExpired) as exc:
        torch_info = {"torch_error": f"{type(exc).__name__}: {exc}"}
    return Probe(torch_info, _tool_output(["nvidia-smi", "-L"]), _tool_output(["amd-smi", "list"]))


def skip_reason() -> str | None:
    """The reason every GPU check is skipped on this machine, or None when they run (a device, or the dry run)."""
    if DRY_RUN:
        return None
    return probe().no_device_reason()


# --- the workload --------------------------------------------------------------------------


def workload_argv(mode: str, max_steps: int, *extra: str, deterministic: bool = False) -> list[str]:
    """The command of one training job: the GPU workload at full size, or tiny on the CPU in the dry run."""
    argv = [training_python(), str(WORKLOAD), "--mode", mode, "--max_steps", str(max_steps)]
    if DRY_RUN:
        argv += ["--size", "tiny", "--seq_len", "64", "--precision", "fp32", "--examples", "512"]
    if deterministic:
        argv.append("--deterministic")
    return argv + list(extra)


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """The JSON objects of a file, one a line; lines that are not JSON (a cut last line) are skipped."""
    out = []
    with contextlib.suppress(OSError):
        for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
            with contextlib.suppress(ValueError):
                item = json.loads(line)
                if isinstance(item, dict):
                    out.append(item)
    return out


def logged_steps(run_dir: Path) -> dict[int, tuple[float | None, float | None]]:
    """Each step's loss and grad norm as the Trainer logged them, from the run's metrics.jsonl."""
    return {
        int(x["step"]): (x.get("loss"), x.get("grad_norm"))
        for x in read_jsonl(run_dir / "metrics.jsonl")
        if x.get("event") == "log" and "loss" in x
    }


def checkpoint_bytes(directory: Path) -> int:
    """The bytes of every regular file under a checkpoint directory."""
    return sum(p.stat().st_size for p in directory.rglob("*") if p.is_file() and not p.is_symlink())


def filesystem_of(path: Path) -> str:
    """`<type> on <mount point>` of the filesystem holding `path`, from /proc/mounts (the longest mount prefix)."""
    best = ("", "unknown")
    resolved = str(path.resolve())
    with contextlib.suppress(OSError):
        for line in Path("/proc/mounts").read_text().splitlines():
            parts = line.split()
            if len(parts) >= 3:
                mount = parts[1]
                inside = resolved == mount or resolved.startswith(mount.rstrip("/") + "/")
                if inside and len(mount) >= len(best[0]):
                    best = (mount, parts[2])
    return f"{best[1]} on {best[0] or '?'}"


# --- results -------------------------------------------------------------------------------


def record(check: str, name: str, value: Any, unit: str = "", source: str = "") -> None:
    """Keep one measured figure of a check: printed, and appended to `OBD_GPU_RESULTS` when it is set."""
    if DRY_RUN:
        source = f"dry run (CPU, tiny model): {source}"
    entry = {"check": check, "name": name, "value": value, "unit": unit, "source": source, "time": time.time()}
    print(f"RESULT {check} | {name} = {value} {unit} ({source})", flush=True)
    path = os.environ.get("OBD_GPU_RESULTS")
    if path:
        with open(path, "a", encoding="utf-8") as f:
            f.write(json.dumps(entry, default=str) + "\n")


def artifacts_dir() -> Path | None:
    """Where a check leaves a file worth keeping (`OBD_GPU_ARTIFACTS`, set by scripts/gpu_check.sh), or None."""
    value = os.environ.get("OBD_GPU_ARTIFACTS")
    if not value:
        return None
    path = Path(value)
    path.mkdir(parents=True, exist_ok=True)
    return path


# --- a daemon on this machine's GPUs -------------------------------------------------------


@contextlib.contextmanager
def gpu_daemon(root: Path) -> Iterator[Any]:
    """A real `obd daemon` whose local target discovers this machine's GPUs, with the test's PYTHONPATH kept.

    tests/conftest.py's DaemonProc sets PYTHONPATH to the repository alone; on a GPU machine obd's
    own packages may come from a directory on PYTHONPATH (scripts/gpu_check.sh installs them
    there), so it is kept after the repository.
    """
    from tests.conftest import DaemonProc, kill_leftover_jobs

    daemon = DaemonProc(root, GPU_CONFIG)
    inherited = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and p != str(REPO)]
    daemon.env["PYTHONPATH"] = os.pathsep.join([str(REPO), *inherited])
    daemon.start()
    try:
        yield daemon
    finally:
        daemon.stop()
        kill_leftover_jobs(daemon.state_dir)


def start_run(daemon: Any, argv: list[str], *opts: str) -> str:
    """`obd train start [opts] -- argv`; the new run's id."""
    out = daemon.cli("train", "start", *opts, "--", *argv)
    assert out.returncode == 0, f"obd train start failed ({out.returncode}): {out.stderr}"
    return out.stdout.strip()


def wait_final(daemon: Any, run_id: str, timeout: float = 600) -> dict[str, Any]:
    """The run's record once it ended, whatever the state."""
    record: dict[str, Any] = daemon.wait_state(run_id, "succeeded", "failed", "cancelled", "stopped", timeout=timeout)
    return record


def job_log_tail(record: dict[str, Any], chars: int = 4000) -> str:
    """The end of a run's job.log, for assertion messages."""
    with contextlib.suppress(OSError, KeyError, TypeError):
        return (Path(record["remote_dir"]) / "job.log").read_text(errors="replace")[-chars:]
    return "(no job.log)"


def stop_when_running(daemon: Any, run_id: str, at_step: int = 1, timeout: float = 300) -> float:
    """Wait until the run logged `at_step` with snapshots announced, then `obd train stop`; the time the stop was asked."""
    from tests.conftest import wait_for

    def ready() -> bool:
        r = daemon.record(run_id)
        if r["state"] not in ("running", "preparing", "queued"):
            raise AssertionError(f"run {run_id} ended before it could be stopped: {r['message']}\n{job_log_tail(r)}")
        return bool(r.get("snapshots") and ((r.get("progress") or {}).get("step") or 0) >= at_step)

    wait_for(ready, timeout, 0.05, f"run {run_id} to announce snapshots and log step {at_step}")
    asked = time.time()
    out = daemon.cli("train", "stop", run_id)
    assert out.returncode == 0, f"obd train stop failed ({out.returncode}): {out.stderr}"
    return asked
