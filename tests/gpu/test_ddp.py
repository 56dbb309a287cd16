"""DDP over NCCL on two GPUs: a stop reaches every rank at the same step.

A LoRA run under `torchrun --nproc_per_node 2`, given two GPUs with `--gpus 2`, stopped with
`obd train stop` once it logged its first step. Each rank's own callback (the workload's) writes
the step it ended at: every rank must end at the proof's step. On a machine with one GPU the test
is skipped, saying so.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.gpu import harness

pytestmark = pytest.mark.gpu
CHECK = "DDP with NCCL"
RANKS = 2
MAX_STEPS = 400


def test_under_ddp_over_nccl_every_rank_stops_at_the_proofs_step(
    request: pytest.FixtureRequest, probe: harness.Probe, tmp_path: Path
) -> None:
    if harness.DRY_RUN:
        pytest.skip("dry run on the CPU: NCCL needs GPUs")
    if probe.device_count < RANKS:
        harness.record(
            CHECK, "skipped", f"{probe.device_count} GPU(s)", "", "torch.cuda.device_count() in the training Python"
        )
        pytest.skip(f"DDP with NCCL needs {RANKS} GPUs; this machine has {probe.device_count}")
    gpu_daemon: Any = request.getfixturevalue("gpu_daemon")  # only once there are GPUs enough
    timings = tmp_path / "timings.json"
    script = harness.workload_argv("lora", MAX_STEPS, "--timings", str(timings))
    argv = [script[0], "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={RANKS}", *script[1:]]
    run_id = harness.start_run(gpu_daemon, argv, "--gpus", str(RANKS), "--name", "ddp")
    harness.stop_when_running(gpu_daemon, run_id, at_step=1)
    record = harness.wait_final(gpu_daemon, run_id)
    assert record["state"] == "stopped", f"{record['message']}\n{harness.job_log_tail(record)}"
    step = record["snapshot"]["step"]
    ended = [json.loads(timings.read_text())["global_step"]]
    ended += [json.loads(Path(f"{timings}.rank{rank}").read_text())["global_step"] for rank in range(1, RANKS)]
    assert ended == [step] * RANKS, f"ranks ended at {ended}, the proof is at step {step}"
    begin = harness.read_jsonl(Path(record["remote_dir"]) / "metrics.jsonl")[0]
    assert begin["world_size"] == RANKS
    harness.record(
        CHECK,
        "every rank's last step",
        ", ".join(map(str, ended)),
        "",
        f"each rank's on_train_end; proof at step {step}",
    )
