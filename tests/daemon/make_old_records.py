"""Writes the records in tests/daemon/records_a91c419/ with the RunStore of main a91c419 (the
release before the run state machine and the record's typed parts), for
test_old_records.py: one record a kind of run, every feature field set. Kept to show how the
fixtures were made; they are committed, and not made again by the tests.

    mkdir /tmp/old && git archive a91c419 daemon executors trainer_plugin runner | tar -x -C /tmp/old
    PYTHONPATH=/tmp/old python tests/daemon/make_old_records.py tests/daemon/records_a91c419
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path

from daemon.models import (  # a91c419's, by PYTHONPATH
    BadCheckpoint,
    Dependency,
    Limits,
    Paused,
    Preemption,
    RunRecord,
    RunState,
    Snapshot,
    SweepTag,
    Trackers,
)
from daemon.store import RunStore

T0 = 1764547200.0  # 2025-12-01, so the files do not change when made again


def walk(r: RunRecord, *steps: tuple[RunState, str]) -> RunRecord:
    for i, (state, why) in enumerate(steps):
        r.transition(state, why, at=T0 + 10 * (i + 1))
    return r


def records() -> list[RunRecord]:
    base = {"created": T0, "remote_dir": "/srv/obd/state/jobs/", "cwd": "/home/ana/project", "owner_uid": 1001}
    common = {"owner": "ana", "command": ["python", "train.py", "--lr", "1e-4"], "env_names": ["HF_HOME"]}

    def make(rid: str, **fields: object) -> RunRecord:
        merged = {**base, **common, **fields}
        merged["remote_dir"] = f"{base['remote_dir']}{rid}"
        return RunRecord(id=rid, **merged)

    succeeded = walk(
        make("20251201-000000-aaaaa1", name="sft", gpus_wanted=2, gpus=["0", "1"], keep_checkpoints=2),
        (RunState.running, "started (pid 4242)"),
        (RunState.succeeded, "exit 0"),
    )
    succeeded.progress.step, succeeded.progress.max_steps, succeeded.progress.loss = 300, 300, 0.812
    succeeded.progress.last_checkpoint = "output/checkpoint-300"
    succeeded.exit_code = 0
    succeeded.pruned, succeeded.pruned_bytes = ["checkpoint-100", "checkpoint-200"], 2_000_000
    succeeded.trackers = Trackers(root=succeeded.id, target="local", tensorboard_dir="output/runs")
    succeeded.note("snapshot plugin 0.1.0 active", at=T0 + 15)

    stopped = walk(
        make("20251201-000000-aaaaa2", name="paused", priority=-1, preemptible=True),
        (RunState.running, "started (pid 4243)"),
        (RunState.stopped, "snapshot at step 40"),
    )
    stopped.snapshots = True
    stopped.snapshot = Snapshot(checkpoint="output/checkpoint-40", step=40, reason="preempted", time=T0 + 31)
    stopped.preempt = Preemption(
        for_run="20251201-000000-aaaaa3", for_priority=5, needed=1, asked_at=T0 + 20, why="preempted"
    )
    stopped.paused = Paused(by="20251201-000000-aaaaa3", since=T0 + 20, why="preempted for a run of priority 5")
    stopped.preemptions, stopped.paused_seconds, stopped.lost_steps = 1, 12.5, 0
    stopped.stop.requested_at, stopped.stop.reason, stopped.stop.proof_at = T0 + 20, "preempted", T0 + 31
    stopped.stop.asked_by = "obd's preemption"
    stopped.limits = Limits(time_limit=3600.0, max_gpu_hours=10.0, run_seconds=30.0, gpu_seconds=30.0)

    retried = walk(
        make("20251201-000000-aaaaa4", chain="20251201-000000-aaaaa2", attempt=2, retries=3),
        (RunState.queued, "waiting for 1 GPU"),
        (RunState.running, "started (pid 4244)"),
        (RunState.failed, "exit 1"),
    )
    retried.resumed_from, retried.resume_checkpoint = "20251201-000000-aaaaa2", "output/checkpoint-40"
    retried.resume_reason = "the snapshot's proof"
    retried.retried_by, retried.exit_code, retried.not_before = "20251201-000000-aaaaa5", 1, T0 + 100
    retried.bad_checkpoint = BadCheckpoint(run="20251201-000000-aaaaa2", name="checkpoint-40", why="safetensors header")

    member = walk(
        make("20251201-000000-aaaaa6", name="grid-2", after_any=True, queue_since=T0 + 5),
        (RunState.queued, "waiting for 20251201-000000-aaaaa1"),
    )
    member.after = [Dependency(run="20251201-000000-aaaaa1", given="sft", name="sft")]
    member.sweep = SweepTag(
        id="sweep-20251201-000000-bbbbbb",
        name="grid",
        index=2,
        size=4,
        values={"lr": "2e-4"},
        template=["python", "train.py", "--lr", "{lr}"],
    )

    pod = walk(
        make("20251201-000000-aaaaa7", target="pods", gpus_wanted=1, secret_names=["WANDB_API_KEY"]),
        (RunState.preparing, "creating pod"),
        (RunState.running, "launched on pod abc123"),
        (RunState.cancelled, "cancelled by the user"),
    )
    pod.job = {"pid": 17, "pgid": 17, "host": "abc123-64410f1a.proxy.runpod.net"}
    pod.target_info = {"pod_id": "abc123", "cost_per_hr": 0.44, "gpu": "NVIDIA A40", "ended": True}
    pod.stop.cancel_by = "user"
    pod.unreachable_since = T0 + 40

    preparing = make("20251201-000000-aaaaa8", env_from_caller=True, env_clear=False, output_to="/home/ana/out")
    preparing.profile, preparing.snapshot_on_sigterm = True, True
    preparing.metrics = {"step_time_p50": 0.41}
    return [succeeded, stopped, retried, member, pod, preparing]


def main(out: str) -> int:
    state = Path(tempfile.mkdtemp())
    try:
        store = RunStore(state)
        store.ensure()
        for r in records():
            store.save(r)
            Path(out).mkdir(parents=True, exist_ok=True)
            shutil.copy(store.record_path(r.id), Path(out) / f"{r.id}.json")
    finally:
        shutil.rmtree(state)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
