"""NVML samples on the torch.profiler path: the wrapper runs nvidia-smi beside the job, RunMetrics read them.

On an NVIDIA GPU, GPU utilisation and the GPU's memory used come from NVML (through nvidia-smi's
query loop), each with a source naming it; without nvidia-smi nothing changes. The nvidia-smi here
is a fake that prints what nvidia-smi 580 prints for the wrapper's query.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import runner
from runner import nvsmi
from runner.amdsmi import Telemetry, summarise
from runner.assemble import parse_run

WRAP = Path(runner.__file__).resolve().parent / "wrap.py"
HEADER = "index, timestamp, utilization.gpu [%], memory.used [MiB], memory.total [MiB], power.draw [W]\n"
SAMPLES = (
    HEADER
    + "0, 2026/12/04 20:00:00.000, 0 %, 1 MiB, 143771 MiB, 75.12 W\n"
    + "0, 2026/12/04 20:00:00.500, 97 %, 30720 MiB, 143771 MiB, 612.40 W\n"
    + "0, 2026/12/04 20:00:01.000, 98 %, 30720 MiB, 143771 MiB, [N/A]\n"
)

# Answers the wrapper's query like nvidia-smi: once, or every -lms milliseconds until TERM; logs its argv.
FAKE_NVIDIA_SMI = """
import os, sys, time
args = sys.argv[1:]
with open(os.environ["NVSMI_CALLS"], "a") as f:
    f.write(" ".join(args) + "\\n")
print("index, timestamp, utilization.gpu [%], memory.used [MiB], memory.total [MiB], power.draw [W]", flush=True)
loop = float(args[args.index("-lms") + 1]) / 1000 if "-lms" in args else None
n = 0
while True:
    print(f"1, 2026/12/04 20:00:0{n % 10}.000, {50 + n % 50} %, {2048 + 1024 * n} MiB, 143771 MiB, 300.00 W", flush=True)
    n += 1
    if loop is None:
        break
    time.sleep(loop)
"""

JOB = """
import json, os, time
run = os.environ["RUN_DIR"]
start = time.time()
time.sleep(1.0)
lines = [{"event": "begin", "time": start, "max_steps": 4, "snapshots": True, "start_step": 0, "world_size": 1},
         {"event": "log", "time": start + 0.5, "step": 1, "tokens": 100},
         {"event": "log", "time": start + 1.0, "step": 4, "tokens": 400}]
with open(os.path.join(run, "metrics.jsonl"), "w") as f:
    f.write("".join(json.dumps(line) + "\\n" for line in lines))
"""


def test_nvidia_smis_query_csv_folds_into_memory_utilisation_and_power_per_gpu(tmp_path: Path) -> None:
    path = tmp_path / "nvidia_smi.csv"
    path.write_text(SAMPLES)
    telemetry = Telemetry()
    nvsmi.read_query_csv(path, telemetry)
    assert telemetry.samples == 3 and telemetry.warnings == []
    summary = summarise(telemetry)
    assert summary.active_gpus == ["0"]
    assert summary.hbm_peak_gb == pytest.approx(30.0)  # 30720 MiB in GB of 1024 MiB
    assert summary.hbm_total_gb == pytest.approx(143771 / 1024)
    assert summary.gpu_util_pct == pytest.approx((0 + 97 + 98) / 3)
    assert summary.power_avg_w == pytest.approx((75.12 + 612.40) / 2)  # [N/A] is no sample


def test_a_repeated_header_and_a_warning_line_are_not_samples(tmp_path: Path) -> None:
    path = tmp_path / "nvidia_smi.csv"
    path.write_text(SAMPLES + HEADER + "Unable to determine the device handle for GPU 1: Unknown Error\n")
    telemetry = Telemetry()
    nvsmi.read_query_csv(path, telemetry)
    assert telemetry.samples == 3
    assert telemetry.warnings == ["nvidia_smi.csv: 1 unreadable nvidia-smi rows skipped"]


def _cuda_profile(profile: Path) -> None:
    """What the in-job torch.profiler path writes on a CUDA GPU (the parts the metrics read)."""
    profile.mkdir(parents=True)
    (profile / "torch_profile.json").write_text(
        json.dumps(
            {
                "version": 1,
                "state": "done",
                "window": {"profiled_steps": [3, 4, 5]},
                "device": {"kind": "cuda", "name": "NVIDIA H200", "count": 1, "peak_memory_reserved_bytes": 2**34},
                "steps": {},
                "errors": [],
            }
        )
    )
    (profile / "torch_kernels.csv").write_text(
        "name,calls,total_us,device\n"
        "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x256x64,30,900.0,gpu\n"
        "pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<64>>,3,100.0,gpu\n"
    )


def test_run_metrics_of_a_cuda_run_take_utilisation_and_memory_from_nvml_with_their_source(tmp_path: Path) -> None:
    profile = tmp_path / "profile"
    _cuda_profile(profile)
    (profile / "nvidia_smi.csv").write_text(SAMPLES)
    metrics = parse_run(profile)
    assert metrics.device_kind == "cuda"
    assert metrics.gpu_util_pct == pytest.approx((0 + 97 + 98) / 3)
    assert metrics.hbm_peak_gb == pytest.approx(30.0)  # NVML's memory.used, not torch's reservation (16 GiB)
    assert "nvidia-smi, NVML (nvidia_smi.csv): 3 samples of GPU(s) 0" in metrics.sources["gpu_util_pct"]
    assert "utilization.gpu" in metrics.sources["gpu_util_pct"]
    assert "memory.used" in metrics.sources["hbm_peak_gb"]
    assert "nvidia_smi.csv" in metrics.files
    assert not any("no amd-smi or nvidia-smi samples" in w for w in metrics.warnings)


def test_without_nvml_samples_a_cuda_run_says_utilisation_is_unknown(tmp_path: Path) -> None:
    profile = tmp_path / "profile"
    _cuda_profile(profile)
    metrics = parse_run(profile)
    assert metrics.gpu_util_pct is None
    assert metrics.hbm_peak_gb == pytest.approx(16.0)  # the allocator's peak, labelled so
    assert "max_memory_reserved" in metrics.sources["hbm_peak_gb"]
    assert any("no amd-smi or nvidia-smi samples" in w for w in metrics.warnings)


def _run_wrapper(tmp_path: Path, env: dict[str, str]) -> Path:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    job = tmp_path / "job.py"
    job.write_text(textwrap.dedent(JOB))
    argv = runner.wrap_command([sys.executable, str(job)], str(WRAP.parent), str(run_dir), python=sys.executable)
    argv[argv.index("--") : argv.index("--")] = ["--interval", "0.1"]
    full = {k: v for k, v in os.environ.items() if not k.startswith("OBD_") and k != "CUDA_VISIBLE_DEVICES"}
    full.update(RUN_DIR=str(run_dir), OBD_ROCPROFV3="", OBD_AMD_SMI="", OBD_KFD_TOPOLOGY="/nonexistent", **env)
    done = subprocess.run(argv, env=full, capture_output=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    return run_dir


def test_the_wrapper_samples_the_jobs_gpus_with_nvidia_smi_while_it_runs(tmp_path: Path) -> None:
    fake = tmp_path / "nvidia-smi"
    fake.write_text(f"#!{sys.executable}\n" + textwrap.dedent(FAKE_NVIDIA_SMI))
    fake.chmod(0o755)
    calls = tmp_path / "calls"
    env = {"OBD_NVIDIA_SMI": str(fake), "NVSMI_CALLS": str(calls), "CUDA_VISIBLE_DEVICES": "1"}
    run_dir = _run_wrapper(tmp_path, env)
    report = json.loads((run_dir / "profile" / "runner.json").read_text())
    assert report["mode"] == "torch.profiler" and report["nvidia_smi"]["output"] == "nvidia_smi.csv"
    once, loop = calls.read_text().splitlines()[:2]
    assert "-i 1" in once and "-lms 100" in loop and "-i 1" in loop  # only the job's GPU, every 0.1 s
    metrics = parse_run(run_dir / "profile", run_dir / "metrics.jsonl")
    assert metrics.gpu_util_pct is not None and 50 <= metrics.gpu_util_pct <= 100
    assert metrics.hbm_peak_gb is not None and metrics.hbm_peak_gb >= 2.0
    assert "nvidia-smi, NVML" in metrics.sources["gpu_util_pct"]


def test_an_nvidia_smi_that_fails_leaves_the_job_running_and_says_so(tmp_path: Path) -> None:
    fake = tmp_path / "nvidia-smi"
    fake.write_text(
        "#!/bin/sh\necho 'NVIDIA-SMI has failed because it could not communicate with the NVIDIA driver.'\nexit 9\n"
    )
    fake.chmod(0o755)
    run_dir = _run_wrapper(tmp_path, {"OBD_NVIDIA_SMI": str(fake)})
    report = json.loads((run_dir / "profile" / "runner.json").read_text())
    assert report["exit_code"] == 0 and report["nvidia_smi"]["output"] is None
    assert any("nvidia-smi did not answer (exit 9" in note for note in report["notes"])
    assert not (run_dir / "profile" / "nvidia_smi.csv").exists()
