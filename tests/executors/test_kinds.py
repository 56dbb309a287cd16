"""The registry of kinds of target (executors/kinds.py): each kind is one registered class whose
config model, capabilities and hooks the daemon asks, and no other module names a kind (issue 35, item 1)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import get_args

import pytest

from executors.config import AnyTarget, LocalTarget, SlurmTarget, SshTarget
from executors.factory import gpus_counted, is_this_machine, makes_pods, preemption, schedules_jobs
from executors.kinds import KIND_MODULES, Capability, kind_named, kind_of, kinds

REPO = Path(__file__).resolve().parents[2]

# Where a kind may be named: its own package or module, the registry and its lookups, the config
# (the discriminated union of the kinds' models) and a kind's daemon-side rooms.
ROOMS = (
    "executors/config.py",
    "executors/kinds.py",
    "executors/factory.py",
    "executors/local_config.py",
    "executors/local_kind.py",
    "executors/local.py",
    "executors/ssh/",
    "executors/slurm/",
    "executors/runpod/",
    "executors/ray/",
    "daemon/service/config.py",
    "daemon/service/pods.py",
    "daemon/service/pod_record.py",
    "daemon/service/slurm.py",
    "daemon/service/pods_admin.py",
)
NAMED = re.compile(
    r"\b(?:Local|Ssh|Runpod|Slurm|Ray)Target\b|\.kind\s*[!=]=\s*[\"'](?:local|ssh|slurm|runpod|ray)[\"']"
)


def test_every_kind_of_the_config_is_registered_with_its_own_model() -> None:
    registered = kinds()
    models = {get_args(m.model_fields["kind"].annotation)[0] for m in get_args(AnyTarget)}
    assert set(registered) == models
    for name, kind in registered.items():
        assert kind.name == name and "kind" in kind.config.model_fields
        assert kind.capabilities and all(isinstance(c, Capability) for c in kind.capabilities)
    assert len(KIND_MODULES) == len(registered)  # one registration line each


def test_the_daemon_asks_capabilities_never_the_class() -> None:
    local, ssh = LocalTarget(), SshTarget(kind="ssh", host="h")
    slurm = SlurmTarget(kind="slurm")
    assert is_this_machine(local) and not is_this_machine(ssh)
    assert schedules_jobs(slurm) and not schedules_jobs(ssh) and not makes_pods(slurm)
    assert kind_of(local).has(Capability.HANDS_OUT_GPUS) and not kind_of(ssh).has(Capability.HANDS_OUT_GPUS)
    # Typed settings, never a getattr default: only this machine's runs are preemptible.
    assert preemption(local) == (True, 600.0)
    assert preemption(ssh) == (False, 0.0) and preemption(slurm) == (False, 0.0)
    assert gpus_counted(local, 2) == 2 and gpus_counted(slurm.model_copy(update={"gpus_per_node": 4}), 0) == 4


def test_an_unknown_kind_is_refused_with_the_list_of_kinds() -> None:
    from executors.base import ExecutorError

    with pytest.raises(ExecutorError, match="no kind of target is named 'k8s'; the kinds are: local, "):
        kind_named("k8s")


def test_no_module_names_a_kind_outside_its_own_rooms_and_the_registry() -> None:
    offenders = []
    for folder in ("daemon", "executors", "runner", "trainer_plugin", "workloads"):
        for path in sorted((REPO / folder).rglob("*.py")):
            rel = str(path.relative_to(REPO))
            if rel.startswith(ROOMS):
                continue
            for number, line in enumerate(path.read_text().splitlines(), 1):
                if NAMED.search(line) and not line.lstrip().startswith("#"):
                    offenders.append(f"{rel}:{number}: {line.strip()}")
    assert offenders == [], "ask the kinds registry (executors/kinds.py, executors/factory.py) instead:\n" + "\n".join(
        offenders
    )
