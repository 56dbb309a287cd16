"""Under the root service a user's Slurm run works where they ran `obd train start`, as them
(issue 23, item b): with sbatch on the daemon's machine the cluster shares its files, so the
directory a user starts a run from is the job's working directory, as their own `sbatch` would
make it, used in place (not uploaded), and entered by the job as the user.

Root only: throwaway users (tests/users.py) and the real test cluster of tests/executors/slurm.
"""

from __future__ import annotations

import os
from pathlib import Path

from tests import users
from tests.executors.slurm.conftest import slurm_cluster  # noqa: F401 - the shared fixture
from tests.security.test_slurm_as_user import box  # noqa: F401 - the root daemon with a Slurm target
from tests.users import Box

pytestmark = users.needs_root_and_users
accounts = users.accounts


def test_a_users_slurm_run_without_cwd_runs_as_them_in_their_private_directory_they_started_it_from(
    box: Box,  # noqa: F811
) -> None:
    alice = box.alice
    project = alice.home / "project"
    project.mkdir()
    (project / "job.sh").write_text('echo "in $(pwd) as $(id -u)"; echo made > made-here\n')
    for path in (project, project / "job.sh"):
        os.chown(path, alice.uid, alice.gid)
    project.chmod(0o700)  # hers alone: only a job running as her can work in it
    out = box.obd(alice, "train", "start", "--target", "hpc", "--", "sh", "job.sh", cwd=project)
    assert out.returncode == 0, out.stderr
    rid = out.stdout.strip()
    record = box.daemon.wait_state(rid, "succeeded", "failed", "cancelled", timeout=90)
    assert record["state"] == "succeeded", record["message"]
    log = box.obd(alice, "train", "logs", rid)
    assert f"in {project} as {alice.uid}" in log.stdout, log.stdout + log.stderr
    assert (project / "made-here").stat().st_uid == alice.uid
    assert not (Path(record["remote_dir"]) / "src").exists()  # in place, not uploaded
