"""The profiling wrapper on the target: argv safety, what it does without ROCm, and with (fake) ROCm tools."""

from __future__ import annotations

import ast
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

import runner
from runner.assemble import parse_run

WRAP = Path(runner.__file__).resolve().parent / "wrap.py"

FAKE_ROCPROFV3 = """
import os, socket, subprocess, sys
args = sys.argv[1:]
if args == ["--help"]:
    print("usage: rocprofv3 [--kernel-trace] [--stats] [-d OUTPUT_DIRECTORY] [--output-format {csv,json,pftrace}]")
    sys.exit(0)
out = args[args.index("-d") + 1]
command = args[args.index("--") + 1:]
code = subprocess.call(command)
host = os.path.join(out, socket.gethostname())
os.makedirs(host, exist_ok=True)
pid = os.getpid()
with open(os.path.join(host, f"{pid}_kernel_trace.csv"), "w") as f:
    f.write('"Kind","Agent_Id","Queue_Id","Stream_Id","Thread_Id","Dispatch_Id","Kernel_Id","Kernel_Name",'
            '"Correlation_Id","Start_Timestamp","End_Timestamp"\\n')
    for i in range(10):
        name = "void ck_tile::kentry<FmhaFwdKernel<bf16>>(Kargs)" if i % 2 else "Cijk_Alik_Bljk_BBS_BH_MT256x256x64"
        f.write(f'"KERNEL_DISPATCH",2,1,1,{pid},{i + 1},7,"{name}",{i},{1000 + i * 100},{1050 + i * 100}\\n')
sys.exit(code)
"""

# Behaves like an amd-smi that predates `-v`: the first (ROCm 7) form fails, the second works.
FAKE_AMD_SMI = """
import sys, time
args = sys.argv[1:]
if "-v" in args:
    print("usage: amd-smi monitor [-h] ...\\namd-smi monitor: error: unrecognized arguments: -v", file=sys.stderr)
    sys.exit(2)
print("WARNING: User is missing the following required groups: render, video.")
header = "gpu,power_usage,hotspot_temperature,gfx_clk,gfx,mem,vram_used,vram_total"
if "-w" in args:
    interval = float(args[args.index("-w") + 1])
    print("timestamp," + header, flush=True)
    n = 0
    while True:
        print(f"{int(time.time())},0,300,50,2100,{90 + n % 5},1,{20.0 + n},191.5", flush=True)
        n += 1
        time.sleep(interval)
print(header)
print("0,300,50,2100,90,1,20.0,191.5")
"""

JOB = """
import json, os, sys, time
run = os.environ["RUN_DIR"]
with open(os.path.join(run, "seen.json"), "w") as f:
    json.dump({"argv": sys.argv[1:], "OBD_TORCH_PROFILE": os.environ.get("OBD_TORCH_PROFILE"),
               "OBD_PROFILE_DIR": os.environ.get("OBD_PROFILE_DIR")}, f)
start = time.time()
lines = [{"event": "begin", "time": start, "max_steps": 4, "snapshots": True, "start_step": 0, "world_size": 1}]
for step in range(1, 5):
    time.sleep(float(os.environ.get("STEP_SLEEP", "0")))
    lines.append({"event": "log", "time": time.time(), "step": step, "tokens": 100 * step})
with open(os.path.join(run, "metrics.jsonl"), "w") as f:
    f.write("".join(json.dumps(line) + "\\n" for line in lines))
sys.exit(int(os.environ.get("EXIT_CODE", "0")))
"""


def executable(path: Path, body: str) -> str:
    path.write_text(f"#!{sys.executable}\n" + textwrap.dedent(body))
    path.chmod(0o755)
    return str(path)


def fake_gpu(tmp_path: Path) -> dict[str, str]:
    nodes = tmp_path / "topology" / "nodes"
    for node, version in (("0", 0), ("1", 90402)):
        (nodes / node).mkdir(parents=True)
        (nodes / node / "properties").write_text(f"cpu_cores_count 0\ngfx_target_version {version}\n")
    (tmp_path / "kfd").write_text("")
    return {"OBD_KFD_TOPOLOGY": str(nodes), "OBD_KFD_DEVICE": str(tmp_path / "kfd")}


def run_wrapped(tmp_path: Path, command: list[str], env: dict[str, str], interval: str = "1") -> tuple[int, Path]:
    run_dir = tmp_path / "run"
    run_dir.mkdir(exist_ok=True)
    argv = runner.wrap_command(command, str(WRAP.parent), str(run_dir), python=sys.executable)
    argv.insert(argv.index("--"), "--interval")
    argv.insert(argv.index("--"), interval)
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("OBD_")}
    full_env.update(RUN_DIR=str(run_dir), **env)
    done = subprocess.run(argv, env=full_env, capture_output=True, timeout=60, check=False)
    return done.returncode, run_dir


NO_ROCM = {"OBD_ROCPROFV3": "", "OBD_AMD_SMI": "", "OBD_KFD_TOPOLOGY": "/nonexistent", "OBD_KFD_DEVICE": "/nonexistent"}


def test_wrap_command_builds_an_argv_with_the_users_command_after_a_double_dash():
    argv = runner.wrap_command(["python", "train.py", "--lr", "1e-4"], "/runs/r1/plugin", "/runs/r1")
    assert argv == [
        "python3",
        "/runs/r1/plugin/wrap.py",
        "--run-dir",
        "/runs/r1",
        "--",
        "python",
        "train.py",
        "--lr",
        "1e-4",
    ]
    with pytest.raises(ValueError):
        runner.wrap_command([], "/p", "/r")


def test_the_target_files_exist_and_import_only_the_standard_library():
    assert WRAP in runner.TARGET_FILES
    for path in [
        *runner.TARGET_FILES,
        Path(__file__).resolve().parents[2] / "trainer_plugin" / "plugin" / "torch_profile.py",
    ]:
        tree = ast.parse(path.read_text())
        top_level = {node.names[0].name.split(".")[0] for node in tree.body if isinstance(node, ast.Import)}
        top_level |= {
            node.module.split(".")[0] for node in tree.body if isinstance(node, ast.ImportFrom) and node.module
        }
        assert top_level <= set(sys.stdlib_module_names) | {"__future__"}, (path.name, top_level)


def test_any_argv_reaches_the_job_untouched(tmp_path):
    job = executable(tmp_path / "job.py", JOB)
    nasty = ["with space", "quote'\"s", "$(touch /tmp/x); rm -rf ~", "new\nline", "ünïcödé", "--", "-d", "*", ""]
    code, run_dir = run_wrapped(tmp_path, [job, *nasty], NO_ROCM)
    assert code == 0
    assert json.loads((run_dir / "seen.json").read_text())["argv"] == nasty


def test_without_rocm_tools_or_gpu_the_job_runs_with_torch_profile_on_and_runner_json_says_what_was_missing(tmp_path):
    job = executable(tmp_path / "job.py", JOB)
    code, run_dir = run_wrapped(tmp_path, [job], {**NO_ROCM, "EXIT_CODE": "3"})
    assert code == 3  # the job's exit status comes through
    seen = json.loads((run_dir / "seen.json").read_text())
    assert seen["OBD_TORCH_PROFILE"] == "1"
    assert seen["OBD_PROFILE_DIR"] == str(run_dir / "profile")
    report = json.loads((run_dir / "profile" / "runner.json").read_text())
    assert report["mode"] == "torch.profiler"
    assert report["missing"] == ["AMD GPU", "rocprofv3", "amd-smi"]
    assert report["state"] == "finished" and report["exit_code"] == 3
    assert any("rocprofv3 not found" in note for note in report["notes"])
    metrics = parse_run(run_dir / "profile", run_dir / "metrics.jsonl")
    assert any("wrapper: no AMD GPU found" in w for w in metrics.warnings)
    assert any("OBD_TORCH_PROFILE=1" in w for w in metrics.warnings)


def test_a_command_that_cannot_start_exits_127_and_still_records_the_end(tmp_path):
    code, run_dir = run_wrapped(tmp_path, [str(tmp_path / "no-such-program")], NO_ROCM)
    assert code == 127
    assert json.loads((run_dir / "profile" / "runner.json").read_text())["exit_code"] == 127


def test_a_job_killed_by_a_signal_exits_with_128_plus_the_signal(tmp_path):
    code, _ = run_wrapped(
        tmp_path, [sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"], NO_ROCM
    )
    assert code == 128 + 9


def test_with_rocprofv3_and_amd_smi_the_job_is_traced_and_sampled_with_the_first_amd_smi_form_that_works(tmp_path):
    job = executable(tmp_path / "job.py", JOB)
    env = {
        **fake_gpu(tmp_path),
        "STEP_SLEEP": "0.3",
        "OBD_ROCPROFV3": executable(tmp_path / "rocprofv3", FAKE_ROCPROFV3),
        "OBD_AMD_SMI": executable(tmp_path / "amd-smi", FAKE_AMD_SMI),
    }
    code, run_dir = run_wrapped(tmp_path, [job], env, interval="0.2")
    assert code == 0
    seen = json.loads((run_dir / "seen.json").read_text())
    assert seen["OBD_TORCH_PROFILE"] is None  # rocprofv3 profiles: no torch.profiler on top
    report = json.loads((run_dir / "profile" / "runner.json").read_text())
    assert report["mode"] == "rocprofv3" and report["missing"] == []
    assert report["rocprofv3"]["command"][1:5] == ["--kernel-trace", "--stats", "--output-format", "csv"]
    assert report["rocprofv3"]["kernel_traces"] == 1
    assert report["amd_smi"]["form"] == "monitor --csv -w N (ROCm 6)"
    assert report["amd_smi"]["tried"][0]["exit_code"] == 2  # the -v form of ROCm 7 was refused
    assert report["amd_smi"]["vram_unit"] == "GB"
    metrics = parse_run(run_dir / "profile", run_dir / "metrics.jsonl")
    assert metrics.profiler == "rocprofv3"
    assert metrics.dispatch_count == 10
    assert metrics.attention_kernel_loaded is True
    assert metrics.hbm_peak_gb is not None and 20.0 <= metrics.hbm_peak_gb < 40.0
    assert metrics.gpu_util_pct is not None and 90 <= metrics.gpu_util_pct <= 94


def test_a_signal_ignored_by_the_wrappers_parent_stays_ignored_for_the_job(tmp_path):
    probe = "import signal, sys; sys.exit(0 if signal.getsignal(signal.SIGHUP) == signal.SIG_IGN else 1)"
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    argv = runner.wrap_command([sys.executable, "-c", probe], str(WRAP.parent), str(run_dir), python=sys.executable)
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("OBD_")}, **NO_ROCM}
    ignore_hup = lambda: signal.signal(signal.SIGHUP, signal.SIG_IGN)  # noqa: E731 - what jobctl does
    assert subprocess.run(argv, env=env, preexec_fn=ignore_hup, timeout=60, check=False).returncode == 0


def test_the_wrapper_outlives_a_term_sent_to_the_whole_group_and_records_the_jobs_end(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    job = "import time; time.sleep(30)"
    argv = runner.wrap_command([sys.executable, "-c", job], str(WRAP.parent), str(run_dir), python=sys.executable)
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("OBD_")}, **NO_ROCM}
    process = subprocess.Popen(argv, env=env, start_new_session=True)
    report = run_dir / "profile" / "runner.json"
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and (not report.exists() or '"running"' not in report.read_text()):
        time.sleep(0.05)
    time.sleep(0.2)
    os.killpg(process.pid, signal.SIGTERM)
    assert process.wait(20) == 128 + signal.SIGTERM
    final = json.loads(report.read_text())
    assert final["state"] == "finished" and final["exit_code"] == 128 + signal.SIGTERM
    assert final["signals"] == [signal.SIGTERM]


def test_when_the_profile_directory_cannot_be_made_the_job_still_runs(tmp_path):
    (tmp_path / "run").write_text("a file where the run directory should be")
    argv = runner.wrap_command(
        [sys.executable, "-c", "raise SystemExit(5)"], str(WRAP.parent), str(tmp_path / "run"), python=sys.executable
    )
    done = subprocess.run(argv, env={**os.environ, **NO_ROCM}, capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 5
    assert "running the job unprofiled" in done.stderr
