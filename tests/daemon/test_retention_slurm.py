"""Checkpoint retention on a Slurm target (issue 26 item 5), under the real daemon against the
test cluster (tests/executors/slurm): its run directories are pruned as any other, through the
machine sbatch runs on."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import FAST_CONFIG, REPO, DaemonProc, wait_for
from tests.executors.slurm.cluster import Cluster
from tests.executors.slurm.conftest import slurm_cluster  # noqa: F401 - the shared fixture

PY = sys.executable
PLAIN = str(REPO / "tests" / "trainer_plugin" / "scripts" / "plain_trainer.py")


@pytest.fixture
def hpc(make_daemon, slurm_cluster: Cluster, short_tmp: Path) -> Iterator[DaemonProc]:  # noqa: F811
    workdir = short_tmp / "shared"
    config = FAST_CONFIG + f'\n[targets.hpc]\nkind = "slurm"\nworkdir = "{workdir}"\nvenv = "{sys.prefix}"\n'
    d = make_daemon(config)
    d.env.update(slurm_cluster.env)
    d.start()
    yield d
    d.stop()
    slurm_cluster.run("scancel", "--user=root", check=False)
    wait_for(lambda: not slurm_cluster.stepds(), 30, 0.2, "the cluster's jobs to end")


def test_a_slurm_run_keeping_one_checkpoint_has_the_older_ones_removed_from_its_run_directory(
    hpc: DaemonProc, short_tmp: Path
) -> None:
    command = [PY, PLAIN, "--output_dir", "out", "--max_steps", "15", "--save_steps", "5"]
    out = hpc.cli(
        "train", "start", "--target", "hpc", "--keep-checkpoints", "1", "--cwd", str(short_tmp), "--", *command
    )
    assert out.returncode == 0, out.stderr
    rid = out.stdout.strip()
    record = hpc.wait_state(rid, "succeeded", "failed", "cancelled", timeout=180)
    assert record["state"] == "succeeded", record["message"]
    wait_for(lambda: len(hpc.record(rid)["retention"]["pruned"]) == 2, 30, 0.1, "the older ones pruned")
    assert hpc.record(rid)["retention"]["pruned"] == ["checkpoint-5", "checkpoint-10"]
    output = Path(record["remote_dir"]) / "output"
    assert sorted(p.name for p in output.iterdir() if p.name.startswith("checkpoint-")) == ["checkpoint-15"]
    out = hpc.cli("train", "prune", rid, "--keep", "1")
    assert out.returncode == 0 and "freed 0 B (0 checkpoints)" in out.stdout, out.stdout
