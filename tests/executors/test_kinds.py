"""The registry of kinds of target (executors/kinds.py): each kind is one registered class whose
config model, capabilities and hooks the daemon asks, and no other module names a kind (issue 35, item 1)."""

from __future__ import annotations

import inspect
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Any, get_args

import pytest
from pydantic import Field, TypeAdapter, ValidationError

import executors.kinds as registry
from executors.config import AnyTarget, LocalTarget, SlurmTarget, SshTarget, target_union
from executors.config_base import TargetBase
from executors.factory import (
    gpus_counted,
    has_price,
    is_this_machine,
    job_env_names,
    makes_pods,
    preemption,
    run_price,
    schedules_jobs,
)
from executors.kinds import KIND_MODULES, Capability, Kind, kind_named, kind_of, kinds

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("daemon", "executors", "runner", "trainer_plugin", "workloads")
TOY_MODULE = "tests.executors.toy_kind.kind"  # a made-up kind's registration line

# Where a kind may be named: its own package or modules (a config model, a `Kind`, an executor),
# the registry and its lookups, executors/config.py (the union, and the five models re-exported
# for the daemon's config) and a kind's daemon-side rooms.
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
_KIND = r"[\"'](?:local|ssh|slurm|runpod|ray)[\"']"
# A kind's model, a test of a config's kind, or a list of kinds (`{"local", "ssh", ...}`).
NAMED = re.compile(
    rf"\b(?:Local|Ssh|Runpod|Slurm|Ray)Target\b|\.kind\s*[!=]=\s*{_KIND}|[\[{{(]\s*{_KIND}\s*,\s*{_KIND}"
)


def _sources() -> Iterator[tuple[str, str]]:
    """(path from the repository's root, text) of every module of obd's packages."""
    for folder in PACKAGES:
        for path in sorted((REPO / folder).rglob("*.py")):
            yield path.relative_to(REPO).as_posix(), path.read_text()


def _room(module: str) -> str:
    """The room of a kind's module: its package (`executors.ssh.kind`: `executors.ssh.`), or for a
    module beside the registry its name's stem (`executors.local_kind`: `executors.local`)."""
    package, _, name = module.rpartition(".")
    return package + "." if package != "executors" else f"{package}.{name.rsplit('_', 1)[0]}"


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
    for rel, text in _sources():
        if rel.startswith(ROOMS):
            continue
        for number, line in enumerate(text.splitlines(), 1):
            if NAMED.search(line) and not line.lstrip().startswith("#"):
                offenders.append(f"{rel}:{number}: {line.strip()}")
    assert offenders == [], "ask the kinds registry (executors/kinds.py, executors/factory.py) instead:\n" + "\n".join(
        offenders
    )


def test_the_rooms_are_where_the_kinds_are() -> None:
    """Each room is a file or folder that is there, and each kind's package is one of them."""
    assert [room for room in ROOMS if not (REPO / room).exists()] == []
    for module in KIND_MODULES:
        room = _room(module).replace(".", "/")
        assert any(r.startswith(room) or room.startswith(r) for r in ROOMS), module


def test_each_kinds_model_is_in_its_own_package_on_the_shared_base() -> None:
    """A kind's config model lives beside its `Kind` (its package, or `local_config.py` beside
    `local_kind.py`), on `TargetBase`; no other module defines a model with a `kind` of its own."""
    homes = {}
    for name, kind in kinds().items():
        module = type(kind).__module__
        assert module in KIND_MODULES
        assert kind.config.__module__.startswith(_room(module)), (
            f"the model of kind {name!r} ({kind.config.__module__}.{kind.config.__name__}) is not in "
            f"its package ({_room(module)}): move it beside {module}"
        )
        assert issubclass(kind.config, TargetBase)
        homes[name] = Path(inspect.getfile(kind.config)).relative_to(REPO).as_posix()
    # A model with a kind's `kind` (a config, or a record such as a pod's) is in that kind's room.
    rooms = {name: _room(type(kind).__module__).replace(".", "/") for name, kind in kinds().items()}
    defines = re.compile(r"^\s+kind:\s*Literal\[[\"'](\w+)[\"']\]", re.M)
    found = {(rel, kind) for rel, text in _sources() for kind in defines.findall(text)}
    astray = sorted(f"{rel}: kind {kind!r}" for rel, kind in found if not rel.startswith(rooms.get(kind, "\0")))
    assert astray == [], "a kind's model outside its own package"
    assert {(home, name) for name, home in homes.items()} <= found


def test_the_keys_every_kind_takes_are_the_bases_with_one_default() -> None:
    """retry, keep_checkpoints, secrets (and the overflow) come from TargetBase in every kind; a key
    only some kinds take is refused by the others as unknown, as before the base."""
    for kind in kinds().values():
        for key in ("retry", "keep_checkpoints", "secrets", "overflow", "overflow_after"):
            assert repr(kind.config.model_fields[key]) == repr(TargetBase.model_fields[key]), (kind.name, key)
    targets = TypeAdapter(Annotated[AnyTarget, Field(discriminator="kind")])
    assert targets.validate_python({"kind": "ssh", "host": "h", "price_per_gpu_hour": 2}).gpu_hour_price() == 2
    for config in ({"kind": "runpod", "price_per_gpu_hour": 2}, {"kind": "ssh", "host": "h", "preemptible": False}):
        with pytest.raises(ValidationError, match="extra_forbidden"):
            targets.validate_python(config)
    assert targets.validate_python({"kind": "runpod"}).gpu_hour_price() is None


@pytest.fixture
def toy(monkeypatch: pytest.MonkeyPatch) -> Kind[Any]:
    """The made-up kind of tests/executors/toy_kind/ registered for one test (the registry as it
    was, once the test is done)."""
    monkeypatch.setattr(registry, "_KINDS", dict(kinds()))
    monkeypatch.setattr(registry, "KIND_MODULES", (*KIND_MODULES, TOY_MODULE))
    monkeypatch.setattr(registry, "_loaded", False)
    monkeypatch.delitem(sys.modules, TOY_MODULE, raising=False)
    return kind_named("toy")


def test_a_made_up_kind_registered_from_its_own_package_is_found_and_asked(toy: Kind[Any]) -> None:
    from tests.executors.toy_kind.config import ToyTarget

    assert kinds()["toy"] is toy and toy.config is ToyTarget
    target = ToyTarget(kind="toy", slots=3, price_per_gpu_hour=2.0, retry=2)
    assert kind_of(target) is toy
    # Its capabilities, as data.
    assert toy.has(Capability.EXEC) and not toy.has(Capability.CARRIES_FILES)
    assert not is_this_machine(target) and not makes_pods(target) and not schedules_jobs(target)
    # Its hook, and the defaults of a remote machine's (the price per GPU-hour from the base).
    assert gpus_counted(target, 0) == 3
    assert has_price(target) and run_price(target, 3, {}, 0.0) == (6.0, None)
    assert preemption(target) == (False, 0.0) and job_env_names(target) == []
    # The union of the targets' models is the registry's: the toy's config parses, typed.
    union = TypeAdapter(dict[str, Annotated[target_union(), Field(discriminator="kind")]])
    parsed = union.validate_python({"t": {"kind": "toy", "slots": 2}, "l": {"kind": "local"}})
    assert type(parsed["t"]) is ToyTarget and parsed["t"].slots == 2 and parsed["t"].retry == 0
    with pytest.raises(ValidationError, match="extra_forbidden"):
        union.validate_python({"t": {"kind": "toy", "preemptible": True}})


def test_the_registry_is_as_it_was_without_the_made_up_kind() -> None:
    assert "toy" not in kinds() and TOY_MODULE not in KIND_MODULES


def test_a_new_kind_is_its_package_and_one_registration_line() -> None:
    """With its line in KIND_MODULES before anything is imported, the made-up kind is in the
    targets' union the daemon's config is built from (executors/config.py's `Target`), untouched."""
    code = f"""
import executors.kinds as registry
registry.KIND_MODULES += ({TOY_MODULE!r},)
from pydantic import TypeAdapter
from executors.config import Target
from executors.factory import gpus_counted, is_this_machine
target = TypeAdapter(dict[str, Target]).validate_python({{"t": {{"kind": "toy", "slots": 4}}}})["t"]
print(type(target).__name__, gpus_counted(target, 0), is_this_machine(target))
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, env={**os.environ})
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["ToyTarget", "4", "False"]
