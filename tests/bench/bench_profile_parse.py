"""Benchmark: `obd profile parse` on a 1,000,000-row rocprofv3 kernel trace vs csv.DictReader.

    python tests/bench/bench_profile_parse.py [--rows N] [--keep]

Writes a trace in the ROCm 7 rocprofv3 layout into a temporary directory, then runs, each in its
own process so that wall time and peak memory (ru_maxrss from wait4) are the process's own:

  1. `python -m runner.cli DIR --json` (the real `obd profile parse` path: discovery, streaming
     parse, interval merge, classification, JSON output);
  2. the naive way: `csv.DictReader` into a list, then a sum of durations per kernel name.

Goal: the parser in at most half the naive time and under 200 MB.
"""

from __future__ import annotations

import argparse
import csv
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

HEADER = [
    "Kind",
    "Agent_Id",
    "Queue_Id",
    "Stream_Id",
    "Thread_Id",
    "Dispatch_Id",
    "Kernel_Id",
    "Kernel_Name",
    "Correlation_Id",
    "Start_Timestamp",
    "End_Timestamp",
    "LDS_Block_Size",
    "Scratch_Size",
    "VGPR_Count",
    "Accum_VGPR_Count",
    "SGPR_Count",
    "Workgroup_Size_X",
    "Workgroup_Size_Y",
    "Workgroup_Size_Z",
    "Grid_Size_X",
    "Grid_Size_Y",
    "Grid_Size_Z",
]

NAIVE = r"""
import csv, sys
with open(sys.argv[1], newline="") as f:
    rows = list(csv.DictReader(f))
totals = {}
for row in rows:
    d = int(row["End_Timestamp"]) - int(row["Start_Timestamp"])
    totals[row["Kernel_Name"]] = totals.get(row["Kernel_Name"], 0) + d
grand = sum(totals.values())
top = sorted(totals.items(), key=lambda kv: -kv[1])[:10]
print(len(rows), len(totals), [(n[:40], round(100 * t / grand, 2)) for n, t in top])
"""


def kernel_names(count: int = 60) -> list[str]:
    """Names like PyTorch's on ROCm: long Tensile GEMMs, templated elementwise kernels, CK attention."""
    rng = random.Random(7)
    names = []
    for i in range(count):
        kind = i % 4
        if kind == 0:
            names.append(
                f"Cijk_Alik_Bljk_BBS_BH_Bias_HA_S_SAV_UserArgs_MT{rng.choice([64, 128, 256])}x256x64_MI16x16x1_"
                + "_".join(f"K{rng.randint(0, 9)}{j}" for j in range(40))
            )
        elif kind == 1:
            names.append(
                f"void at::native::vectorized_elementwise_kernel<4, at::native::op{i}<c10::BFloat16>, "
                f"at::detail::Array<char*, {i % 3 + 2}> >(int, at::native::op{i}<c10::BFloat16>, "
                f"at::detail::Array<char*, {i % 3 + 2}>)"
            )
        elif kind == 2:
            names.append(
                f"void ck_tile::kentry<128, 1, ck_tile::FmhaFwdKernel<variant{i}, ck_tile::bf16_t, "
                "float, ck_tile::TileFmhaShape<ck_tile::sequence<128, 128, 32>>>>(FmhaFwdBatchModeKargs)"
            )
        else:
            names.append(f"__amd_rocclr_copyBuffer_{i}")
    return names


def write_trace(path: Path, rows: int) -> None:
    rng = random.Random(11)
    names = kernel_names()
    weights = [rng.randint(1, 20) for _ in names]
    picks = rng.choices(range(len(names)), weights=weights, k=rows)
    t = 5_329_321_973_213_203
    with open(path, "w", newline="") as f:
        writer = csv.writer(f, quoting=csv.QUOTE_MINIMAL, lineterminator="\n")
        f.write(",".join(f'"{h}"' for h in HEADER) + "\n")
        for n, k in enumerate(picks, 1):
            duration = 2_000 + (k * 997) % 180_000
            start = t
            t += duration + rng.randint(500, 4_000)
            writer.writerow(
                [
                    "KERNEL_DISPATCH",
                    2,
                    1,
                    1 + k % 2,
                    4021,
                    n,
                    10 + k,
                    names[k],
                    n,
                    start,
                    start + duration,
                    8192,
                    0,
                    128,
                    0,
                    96,
                    256,
                    1,
                    1,
                    1024,
                    1,
                    1,
                ]
            )


def measure(argv: list[str]) -> tuple[float, float, int]:
    """(wall seconds, peak RSS MB, exit status) of one child process."""
    started = time.perf_counter()
    process = subprocess.Popen(argv, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(process.pid, 0)
    wall = time.perf_counter() - started
    process.returncode = os.waitstatus_to_exitcode(status)
    if process.returncode:
        sys.stderr.write(process.stderr.read().decode() if process.stderr else "")
    return wall, usage.ru_maxrss / 1024, process.returncode


def run(rows: int, keep: bool) -> dict:
    tmp = Path(tempfile.mkdtemp(prefix="obd-bench-"))
    try:
        trace_dir = tmp / "profile" / "rocprof" / "benchhost"
        trace_dir.mkdir(parents=True)
        trace = trace_dir / "4021_kernel_trace.csv"
        t0 = time.perf_counter()
        write_trace(trace, rows)
        size_mb = trace.stat().st_size / 1e6
        print(f"trace: {rows:,} rows, {size_mb:.0f} MB, written in {time.perf_counter() - t0:.1f} s ({trace})")
        ours = measure([sys.executable, "-m", "runner.cli", str(tmp), "--json"])
        naive = measure([sys.executable, "-c", NAIVE, str(trace)])
        result = {
            "rows": rows,
            "size_mb": size_mb,
            "parse_s": ours[0],
            "parse_mb": ours[1],
            "naive_s": naive[0],
            "naive_mb": naive[1],
            "ratio": ours[0] / naive[0],
            "ok": ours[2] == 0 and naive[2] == 0,
        }
        print(f"obd profile parse : {ours[0]:6.2f} s  peak {ours[1]:7.1f} MB  (exit {ours[2]})")
        print(f"DictReader + list : {naive[0]:6.2f} s  peak {naive[1]:7.1f} MB  (exit {naive[2]})")
        print(
            f"time ratio parse/naive = {result['ratio']:.2f} (goal <= 0.5); memory ratio = "
            f"{ours[1] / naive[1]:.3f}; parse peak goal < 200 MB: {'met' if ours[1] < 200 else 'NOT met'}"
        )
        return result
    finally:
        if keep:
            print(f"kept {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)


@pytest.mark.bench
def test_parsing_a_million_row_trace_takes_half_the_naive_time_and_under_200_mb():
    result = run(1_000_000, keep=False)
    assert result["ok"]
    assert result["parse_mb"] < 200
    assert result["ratio"] <= 0.5


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--keep", action="store_true", help="keep the generated trace")
    args = parser.parse_args()
    result = run(args.rows, args.keep)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
