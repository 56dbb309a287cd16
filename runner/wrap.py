#!/usr/bin/env python3
"""obd's profiling wrapper: runs a training command under rocprofv3, with amd-smi sampled beside it.

obd copies this file into the run's `plugin/` directory and runs, on the target,

    python3 wrap.py --run-dir RUN_DIR [--interval SECONDS] -- COMMAND [ARG]...

instead of the command itself when a run is started with `--profile`. Standard library only:
the target need not have obd installed.

- With rocprofv3 and an AMD GPU: the command runs as `rocprofv3 --kernel-trace --stats
  --output-format csv -d RUN_DIR/profile/rocprof -- COMMAND...` (rocprofv3's default
  `HOST/PID_kernel_trace.csv` layout under that directory).
- With amd-smi and an AMD GPU: `amd-smi monitor --csv` is sampled in the background into
  `profile/amdsmi_monitor.csv`, trying the command forms of ROCm 7 and 6 in turn and keeping
  the first that works; `amd-smi metric --json` polled into `profile/amdsmi_metric.jsonl` is the
  last resort.
- Without them: the command runs as it is, with `OBD_TORCH_PROFILE=1` in its environment, so
  the in-job torch.profiler path profiles a window of steps instead; where `nvidia-smi` is
  found, NVML's utilisation, memory and power of the job's GPUs (`CUDA_VISIBLE_DEVICES`, else
  all) are sampled beside it into `profile/nvidia_smi.csv` (`nvidia-smi --query-gpu=... -lms N`).

Whatever is missing, the job runs. `profile/runner.json` records what was found, what was
missing, what ran and how it ended. The wrapper exits with the command's exit status.
Test hooks: OBD_ROCPROFV3 / OBD_AMD_SMI / OBD_NVIDIA_SMI (tool paths, empty to disable),
OBD_KFD_TOPOLOGY and OBD_KFD_DEVICE (where to look for AMD GPUs).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time

VERSION = 1
PROBE_TIMEOUT = 30.0
DEFAULT_INTERVAL = 1.0

# amd-smi monitor forms, newest first: (description, arguments, watch arguments, VRAM unit).
# `-v` makes vram_used MB (and adds vram_free, vram_percent); without it vram_used is GB.
MONITOR_FORMS = (
    ("monitor -p -u -m -v --csv -w N (ROCm 6.4+/7)", ["monitor", "-p", "-u", "-m", "-v", "--csv"], ["-w"], "MB"),
    ("monitor --csv -w N (ROCm 6)", ["monitor", "--csv"], ["-w"], "GB"),
    ("monitor --csv --watch N (early ROCm 6)", ["monitor", "--csv"], ["--watch"], "GB"),
)
# NVML's figures through nvidia-smi, in the columns runner/nvsmi.py reads (units in the header and cells).
NVIDIA_QUERY = "--query-gpu=index,timestamp,utilization.gpu,memory.used,memory.total,power.draw"
NVIDIA_OUTPUT = "nvidia_smi.csv"
METRIC_FORMS = (
    ("metric -u -p -m --json", ["metric", "-u", "-p", "-m", "--json"]),
    ("metric --json", ["metric", "--json"]),
)


def atomic_write(path: str, data: str) -> None:
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def find_tool(name: str, override_var: str) -> str | None:
    """A tool's path: the override variable if set (empty disables), else PATH, else /opt/rocm/bin."""
    if override_var in os.environ:
        value = os.environ[override_var]
        return value if value and os.access(value, os.X_OK) else None
    rocm = os.environ.get("ROCM_PATH", "/opt/rocm")
    search = os.pathsep.join(p for p in (os.environ.get("PATH", ""), os.path.join(rocm, "bin")) if p)
    return shutil.which(name, path=search)


def detect_amd_gpu() -> dict:
    """AMD GPUs from the KFD topology (nodes with a non-zero gfx_target_version) and /dev/kfd."""
    topology = os.environ.get("OBD_KFD_TOPOLOGY", "/sys/class/kfd/kfd/topology/nodes")
    device = os.environ.get("OBD_KFD_DEVICE", "/dev/kfd")
    gpus = []
    try:
        nodes = sorted(os.listdir(topology), key=lambda n: int(n) if n.isdigit() else 0)
    except OSError:
        nodes = []
    for node in nodes:
        try:
            with open(os.path.join(topology, node, "properties"), encoding="utf-8") as f:
                props = dict(line.split(None, 1) for line in f if len(line.split(None, 1)) == 2)
            version = int(props.get("gfx_target_version", "0").strip() or 0)
        except (OSError, ValueError):
            continue
        if version > 0:
            gpus.append({"node": node, "gfx_target_version": version})
    has_device = os.path.exists(device)
    evidence = f"{len(gpus)} GPU node(s) in {topology}; {device} {'present' if has_device else 'missing'}"
    return {"present": bool(gpus) and has_device, "gpus": gpus, "evidence": evidence}


def probe(argv: list[str]) -> tuple[int | None, str]:
    """Run a short command; (exit status or None if it could not run, its output)."""
    try:
        done = subprocess.run(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            timeout=PROBE_TIMEOUT,
            check=False,
        )
    except (OSError, subprocess.SubprocessError) as exc:
        return None, f"{type(exc).__name__}: {exc}"
    return done.returncode, done.stdout.decode("utf-8", "replace")


def looks_like_monitor_csv(output: str) -> bool:
    """amd-smi printed a CSV header with a gpu column (after any warning preamble)."""
    for line in output.splitlines():
        cells = [c.strip().lower() for c in line.split(",")]
        if "gpu" in cells and len(cells) > 1:
            return True
    return False


class Sampler(threading.Thread):
    """Samples amd-smi in the background, choosing the first command form that works."""

    def __init__(self, amd_smi: str, profile_dir: str, interval: float) -> None:
        super().__init__(name="obd-amd-smi", daemon=True)
        self.amd_smi, self.profile_dir, self.interval = amd_smi, profile_dir, interval
        self.stopping = threading.Event()
        self.record: dict = {"path": amd_smi, "tried": [], "form": None, "output": None, "vram_unit": None}
        self.process: subprocess.Popen | None = None

    def run(self) -> None:
        try:
            if not self._monitor():
                self._poll_metric()
        except Exception as exc:  # the sampler must never affect the job
            self.record["error"] = f"{type(exc).__name__}: {exc}"

    def _monitor(self) -> bool:
        out_path = os.path.join(self.profile_dir, "amdsmi_monitor.csv")
        for description, args, watch, unit in MONITOR_FORMS:
            if self.stopping.is_set():
                return True
            code, output = probe([self.amd_smi, *args])
            attempt: dict[str, object] = {"command": [self.amd_smi, *args], "exit_code": code}
            if code != 0 or not looks_like_monitor_csv(output):
                attempt["error"] = output.strip()[-300:]
                self.record["tried"].append(attempt)
                continue
            argv = [self.amd_smi, *args, *watch, f"{self.interval:g}"]
            with open(out_path, "wb") as out, open(out_path + ".err", "wb") as err:
                self.process = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=err)
                # A watch flag this amd-smi does not know fails at once: give it a moment, then try the next.
                early = self._wait(self.process, min(3.0, 3 * self.interval))
            if early is not None and early != 0 and not self.stopping.is_set():
                attempt["watch_exit_code"] = early
                self.record["tried"].append(attempt)
                continue
            self.record["tried"].append(attempt)
            self.record.update(form=description, command=argv, output="amdsmi_monitor.csv", vram_unit=unit)
            self.stopping.wait()
            self._stop_process()
            return True
        return False

    def _poll_metric(self) -> None:
        for description, args in METRIC_FORMS:
            code, output = probe([self.amd_smi, *args])
            attempt: dict[str, object] = {"command": [self.amd_smi, *args], "exit_code": code}
            document = _json_in(output) if code == 0 else None
            if document is None:
                attempt["error"] = output.strip()[-300:]
                self.record["tried"].append(attempt)
                continue
            self.record["tried"].append(attempt)
            self.record.update(form=description, command=[self.amd_smi, *args], output="amdsmi_metric.jsonl")
            path = os.path.join(self.profile_dir, "amdsmi_metric.jsonl")
            with open(path, "a", encoding="utf-8") as out:
                while document is not None:
                    out.write(json.dumps({"time": time.time(), "data": document}) + "\n")
                    out.flush()
                    if self.stopping.wait(self.interval):
                        return
                    code, output = probe([self.amd_smi, *args])
                    document = _json_in(output) if code == 0 else None
            return
        self.record["error"] = "no amd-smi command form worked"

    def _wait(self, process: subprocess.Popen, seconds: float) -> int | None:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline and not self.stopping.is_set():
            code = process.poll()
            if code is not None:
                return code
            time.sleep(0.05)
        return process.poll()

    def _stop_process(self) -> None:
        process = self.process
        if process is None or process.poll() is not None:
            return
        process.terminate()
        try:
            process.wait(5)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()

    def stop(self) -> None:
        self.stopping.set()
        self.join(PROBE_TIMEOUT + 10)
        self._stop_process()


def nvidia_ids(env: dict) -> str | None:
    """The job's GPUs for `nvidia-smi -i`: CUDA_VISIBLE_DEVICES when it lists indices or UUIDs, else None (all)."""
    value = env.get("CUDA_VISIBLE_DEVICES")
    if not value:
        return None
    ids = [part.strip() for part in value.split(",")]
    if all(part.isdigit() or part.startswith(("GPU-", "MIG-")) for part in ids):
        return ",".join(ids)
    return None


class NvidiaSampler:
    """`nvidia-smi --query-gpu ... -lms N` writing NVML samples to profile/nvidia_smi.csv while the job runs."""

    def __init__(self, nvidia_smi: str, profile_dir: str, interval: float, ids: str | None) -> None:
        self.once = [nvidia_smi, NVIDIA_QUERY, "--format=csv", *(["-i", ids] if ids else [])]
        self.argv = [*self.once, "-lms", str(max(100, int(interval * 1000)))]
        self.path = os.path.join(profile_dir, NVIDIA_OUTPUT)
        self.record: dict = {"path": nvidia_smi, "command": self.argv, "output": None}
        self.process: subprocess.Popen | None = None

    def start(self) -> bool:
        """Start sampling once a one-shot query answers; False (said in `record`) when it does not."""
        code, output = probe(self.once)
        if code != 0 or "utilization.gpu" not in output:
            self.record["error"] = f"exit {code}: {output.strip()[-300:]}"
            return False
        with open(self.path, "wb") as out, open(self.path + ".err", "wb") as err:
            self.process = subprocess.Popen(self.argv, stdin=subprocess.DEVNULL, stdout=out, stderr=err)
        self.record["output"] = NVIDIA_OUTPUT
        return True

    def stop(self) -> None:
        process = self.process
        if process is None or process.poll() is not None:
            return
        process.terminate()
        try:
            process.wait(5)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def _json_in(output: str) -> object | None:
    """The JSON document in amd-smi's output, after any warning lines."""
    starts = [i for i in (output.find("["), output.find("{")) if i >= 0]
    if not starts:
        return None
    try:
        return json.loads(output[min(starts) :])
    except ValueError:
        return None


def rocm_version() -> str | None:
    path = os.path.join(os.environ.get("ROCM_PATH", "/opt/rocm"), ".info", "version")
    try:
        with open(path, encoding="utf-8") as f:
            return f.read().strip() or None
    except OSError:
        return None


def torch_version_probe(command: list[str], record: dict) -> threading.Thread:
    """Ask the job's Python (or ours) for torch.__version__, in the background."""
    first = os.path.basename(command[0]) if command else ""
    python = command[0] if first.startswith("python") else sys.executable

    def run() -> None:
        code, output = probe([python, "-c", "import torch; print(torch.__version__)"])
        lines = output.strip().splitlines()
        if code == 0 and lines:
            record["pytorch_version"] = lines[-1].strip()
            record["pytorch_version_from"] = python

    thread = threading.Thread(target=run, name="obd-torch-version", daemon=True)
    thread.start()
    return thread


def rocprof_command(rocprofv3: str, trace_dir: str, command: list[str], help_text: str) -> list[str]:
    """The rocprofv3 command line; `--output-format csv` only where this rocprofv3 knows it."""
    argv = [rocprofv3, "--kernel-trace", "--stats"]
    if "--output-format" in help_text:
        argv += ["--output-format", "csv"]  # ROCm 7 defaults to rocpd (SQLite); CSV is streamed row by row
    return [*argv, "-d", trace_dir, "--", *command]


def parse_args(argv: list[str]) -> tuple[str, float, list[str]]:
    if "--" not in argv:
        raise SystemExit("usage: wrap.py --run-dir RUN_DIR [--interval SECONDS] -- COMMAND [ARG]...")
    split = argv.index("--")
    options, command = argv[:split], argv[split + 1 :]
    run_dir, interval = None, DEFAULT_INTERVAL
    i = 0
    while i < len(options):
        if options[i] == "--run-dir" and i + 1 < len(options):
            run_dir, i = options[i + 1], i + 2
        elif options[i] == "--interval" and i + 1 < len(options):
            interval, i = max(0.1, float(options[i + 1])), i + 2
        else:
            raise SystemExit(f"wrap.py: unknown option {options[i]!r}")
    if not run_dir or not command:
        raise SystemExit("usage: wrap.py --run-dir RUN_DIR [--interval SECONDS] -- COMMAND [ARG]...")
    return run_dir, interval, command


def main(argv: list[str]) -> int:
    run_dir, interval, command = parse_args(argv)
    profile_dir = os.path.join(run_dir, "profile")
    try:
        os.makedirs(profile_dir, exist_ok=True)
    except OSError as exc:  # nowhere to profile into: the job still runs, unprofiled
        print(f"obd wrap: cannot create {profile_dir} ({exc}); running the job unprofiled", file=sys.stderr, flush=True)
        return _run_plain(command)
    report_path = os.path.join(profile_dir, "runner.json")
    report: dict = {
        "version": VERSION,
        "host": socket.gethostname(),
        "started": time.time(),
        "command": command,
        "state": "starting",
        "missing": [],
        "notes": [],
    }
    env = dict(os.environ)
    env["OBD_PROFILE_DIR"] = profile_dir
    sampler: Sampler | None = None
    nvidia: NvidiaSampler | None = None
    version_thread: threading.Thread | None = None
    argv_run = list(command)
    try:
        gpu = detect_amd_gpu()
        rocprofv3 = find_tool("rocprofv3", "OBD_ROCPROFV3")
        amd_smi = find_tool("amd-smi", "OBD_AMD_SMI")
        report.update(
            amd_gpu=gpu, rocm_version=rocm_version(), rocprofv3={"path": rocprofv3}, amd_smi={"path": amd_smi}
        )
        for label, found in (("AMD GPU", gpu["present"]), ("rocprofv3", rocprofv3), ("amd-smi", amd_smi)):
            if not found:
                report["missing"].append(label)
        if not gpu["present"]:
            report["notes"].append(f"no AMD GPU found ({gpu['evidence']})")
        if amd_smi and gpu["present"]:
            sampler = Sampler(amd_smi, profile_dir, interval)
            sampler.start()
        elif not amd_smi:
            report["notes"].append("amd-smi not found (PATH, $ROCM_PATH/bin): no HBM or utilisation samples")
        else:
            report["notes"].append("amd-smi found but no AMD GPU: not sampled")
        help_code, help_text = probe([rocprofv3, "--help"]) if rocprofv3 and gpu["present"] else (None, "")
        if rocprofv3 and gpu["present"] and help_code == 0:
            argv_run = rocprof_command(rocprofv3, os.path.join(profile_dir, "rocprof"), command, help_text)
            report["mode"] = "rocprofv3"
            report["rocprofv3"]["command"] = argv_run
            version_thread = torch_version_probe(command, report)
        else:
            if rocprofv3 and gpu["present"]:
                report["notes"].append(f"rocprofv3 --help failed (exit {help_code}): {help_text.strip()[-200:]}")
            elif not rocprofv3:
                report["notes"].append("rocprofv3 not found (PATH, $ROCM_PATH/bin): no kernel trace")
            report["notes"].append(
                "the job runs without rocprofv3, with OBD_TORCH_PROFILE=1 "
                "(torch.profiler over a window of steps, inside the job)"
            )
            env["OBD_TORCH_PROFILE"] = "1"
            report["mode"] = "torch.profiler"
            nvidia_smi = None if gpu["present"] else find_tool("nvidia-smi", "OBD_NVIDIA_SMI")
            if nvidia_smi:
                nvidia = NvidiaSampler(nvidia_smi, profile_dir, interval, nvidia_ids(env))
                if not nvidia.start():
                    report["notes"].append(f"nvidia-smi did not answer ({nvidia.record.get('error')}): no NVML samples")
                report["nvidia_smi"] = nvidia.record
        report["env"] = {"OBD_PROFILE_DIR": profile_dir, "OBD_TORCH_PROFILE": env.get("OBD_TORCH_PROFILE")}
    except Exception as exc:  # a wrapper bug must not keep the job from running
        report["notes"].append(f"wrapper setup failed ({type(exc).__name__}: {exc}); the job runs unprofiled")
        argv_run = list(command)
        report["mode"] = "none"
    report["state"] = "running"
    _write(report_path, report)

    # The job's process group gets TERM on a cancel; the wrapper outlives the job to record its end.
    # A signal the wrapper was started ignoring (SIGHUP under nohup/jobctl) stays ignored, so the
    # job inherits the same disposition it would have had without the wrapper.
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        if signal.getsignal(sig) != signal.SIG_IGN:
            signal.signal(sig, lambda signum, frame: report.setdefault("signals", []).append(signum))
    try:
        child = subprocess.Popen(argv_run, env=env, restore_signals=True)
    except OSError as exc:
        print(f"obd wrap: could not start {argv_run[0]!r}: {exc}", file=sys.stderr, flush=True)
        code = 127
    else:
        while True:
            try:
                code = child.wait()
                break
            except InterruptedError:
                continue
    if code < 0:
        code = 128 - code
    if nvidia is not None:
        nvidia.stop()
    if sampler is not None:
        sampler.stop()
        report["amd_smi"].update(sampler.record)
        if not sampler.record.get("form"):
            report["notes"].append("amd-smi: no command form worked; see runner.json amd_smi.tried")
    if version_thread is not None:
        version_thread.join(5)
    if report.get("mode") == "rocprofv3":
        traces = _count_traces(os.path.join(profile_dir, "rocprof"))
        report["rocprofv3"]["kernel_traces"] = traces
        if not traces:
            report["notes"].append(f"rocprofv3 wrote no kernel trace (exit status {code}); see job.log")
    report.update(state="finished", ended=time.time(), exit_code=code)
    _write(report_path, report)
    return code


def _run_plain(command: list[str]) -> int:
    """Run the command with nothing around it and return its exit status (shell convention)."""
    try:
        code = subprocess.call(command)
    except OSError as exc:
        print(f"obd wrap: could not start {command[0]!r}: {exc}", file=sys.stderr, flush=True)
        return 127
    return 128 - code if code < 0 else code


def _count_traces(directory: str) -> int:
    count = 0
    for _, _, files in os.walk(directory):
        count += sum(1 for name in files if name.endswith("kernel_trace.csv"))
    return count


def _write(path: str, report: dict) -> None:
    try:
        atomic_write(path, json.dumps(report, indent=1, default=str))
    except OSError as exc:
        print(f"obd wrap: could not write {path}: {exc}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
