"""What a Ray target submits for a multi-node run, and what obd's Ray driver runs on each node
(pure: no cluster; the real two-node runs are tests/daemon/test_ray_target.py, slow)."""

from __future__ import annotations

from executors.base import JobSpec
from executors.config import RayTarget
from executors.ray import executor, nodes

JOB = JobSpec(run_id="r1", remote_dir="/shared/obd/r1", command=["python", "train.py"], env={"OBD_RUN_ID": "r1"})


def target(**fields: object) -> RayTarget:
    return RayTarget.model_validate({"kind": "ray", "python": "/venv/bin/python", **fields})


def test_a_multi_node_run_asks_its_resources_in_one_bundle_a_node_and_its_driver_asks_none() -> None:
    pair = target(nodes=2, launcher="torchrun", num_cpus=2, num_gpus=1, memory=1000, resources={"a100": 1})
    body = executor.submit_body(pair, JOB, "/venv/bin/python")
    assert [key for key in body if key.startswith("entrypoint_")] == []  # nothing asked for the driver
    plan = executor.nodes_plan(pair, JOB)
    assert plan["bundle"] == {"CPU": 2, "GPU": 1, "memory": 1000.0, "a100": 1}
    assert (plan["nodes"], plan["launcher"], plan["nproc_per_node"]) == (2, "torchrun", 1)  # a process a GPU
    assert plan["command"] == ["python", "train.py"] and plan["grace"] == 15.0
    # One node: the job's own resources, and no driver (the wrapper starts the command or torchrun).
    one = target(num_cpus=2, launcher="torchrun", nproc_per_node=3)
    assert executor.submit_body(one, JOB, "/venv/bin/python")["entrypoint_num_cpus"] == 2
    assert executor.launch_plan(one, "/venv/bin/python")["launcher"] == "torchrun"
    assert executor.launch_plan(one, "/venv/bin/python")["nproc_per_node"] == 3
    assert executor.launch_plan(pair, "/venv/bin/python")["launcher"] == "srun"  # the driver, as given


def test_each_nodes_torchrun_meets_the_others_at_the_first_nodes_rendezvous() -> None:
    plan = executor.nodes_plan(target(nodes=2, launcher="torchrun"), JOB)
    first = nodes.torchrun_argv(plan, "10.0.0.5:29400", 0)
    other = nodes.torchrun_argv(plan, "10.0.0.5:29400", 1)
    assert first[:3] == ["/venv/bin/python", "-m", "torch.distributed.run"]
    for argv in (first, other):
        assert "--nnodes=2" in argv and "--rdzv-endpoint=10.0.0.5:29400" in argv and "--rdzv-id=obd-r1" in argv
        assert argv[-3:] == ["--no-python", "python", "train.py"]
    assert "--rdzv-conf=is_host=1" in first and "--rdzv-conf=is_host=0" in other
    # Each node's torchrun logs in its folder of the run directory, not in a /tmp/torchelastic_* left behind.
    assert "--log-dir=/shared/obd/r1/torchrun/node-0" in first and "--log-dir=/shared/obd/r1/torchrun/node-1" in other
