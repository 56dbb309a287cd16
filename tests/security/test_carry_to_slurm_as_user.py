"""A user's checkpoint carried to a Slurm target on this machine under the root service (issue 36
item 5, for the move local -> Slurm of its "Done when").

Root only: throwaway users (tests/users.py) and the real test cluster of tests/executors/slurm. A
Slurm target whose `sbatch` is on this machine keeps its run directories in this machine's files
(its shared directory): a user's `obd train resume RUN --target hpc` writes the carried checkpoint
there as the user, by the helper that is them (daemon/service/carry_local.py), never staged in
the daemon's state directory nor written by root.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests import users
from tests.conftest import FAST_CONFIG, wait_for
from tests.executors.slurm.cluster import Cluster
from tests.executors.slurm.conftest import slurm_cluster  # noqa: F401 - the shared fixture
from tests.security.test_carry_as_user import stopped_run
from tests.users import Box

pytestmark = users.needs_root_and_users
accounts = users.accounts


@pytest.fixture
def box(make_daemon, slurm_cluster: Cluster, short_tmp: Path, accounts) -> Iterator[Box]:  # noqa: F811
    """A root daemon with this machine (`local`) and a Slurm target of it (`hpc`), shared by two users."""
    alice, bob, group, client, venv = accounts
    os.chmod(short_tmp, 0o711)  # the socket's directory: reachable, not listable
    (short_tmp / "shared").mkdir(mode=0o711)
    (short_tmp / "shared").chmod(0o711)
    config = (
        FAST_CONFIG.replace("[daemon]", f'[daemon]\nsocket_group = "{group}"')
        + f'\n[targets.local]\nkind = "local"\npython = "{venv}/bin/python"\n'
        + f'\n[targets.hpc]\nkind = "slurm"\nworkdir = "{short_tmp / "shared"}"\nvenv = "{venv}"\n'
    )
    d = make_daemon(config)
    d.env.update(slurm_cluster.env)
    d.start()
    box = Box(d, alice, bob, group, client, venv)
    yield box
    box.daemon.stop()
    for user in (box.alice.name, box.bob.name, "root"):
        slurm_cluster.run("scancel", "--full", f"--user={user}", check=False)
    wait_for(lambda: not slurm_cluster.stepds(), 30, 0.2, "the users' Slurm jobs to end")


def test_a_users_checkpoint_resumed_on_a_slurm_target_of_this_machine_is_written_as_theirs(box: Box) -> None:
    alice = box.alice
    source = stopped_run(box)
    staged: list[str] = []
    done = threading.Event()

    def watch() -> None:  # nothing of it is staged in the daemon's own state directory
        while not done.is_set():
            staged.extend(str(p) for p in (box.daemon.state_dir / "runs").glob("*/carry"))
            time.sleep(0.002)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        out = box.obd(alice, "train", "resume", source["id"], "--target", "hpc")
        assert out.returncode == 0, out.stderr
        new = box.daemon.wait_state(out.stdout.strip(), "running", "failed", timeout=120)
    finally:
        done.set()
        watcher.join()
    assert new["state"] == "running", new["message"]
    assert not staged, staged
    name = source["snapshot"]["checkpoint"].rsplit("/", 1)[-1]
    carried = Path(new["remote_dir"]) / "resume" / name
    entries = [carried, *carried.rglob("*")]
    assert {p.relative_to(carried).as_posix() for p in entries if p.is_file()} == {
        "trainer_state.json",
        "sub/model.safetensors",
    }
    for path in entries:  # every file and directory of the copy is alice's, none root's
        st = os.lstat(path)
        assert (st.st_uid, st.st_gid) == (alice.uid, alice.gid), (path, st.st_uid)
    history = "\n".join(h["reason"] for h in box.daemon.record(new["id"])["history"])
    assert f"{name} of {source['id']} carried from target local to hpc" in history
    job_log = Path(new["remote_dir"]) / "job.log"
    step = source["snapshot"]["step"]
    wait_for(lambda: (box.daemon.record(new["id"])["progress"].get("step") or 0) > step, 60, 0.1, "a step there")
    assert job_log.exists()
    box.obd(alice, "train", "cancel", new["id"])
