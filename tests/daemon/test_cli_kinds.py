"""What the `obd` command knows of the kinds of target: only what the daemon's replies say.

The client imports no executor and no config model: whether a target is this machine comes from
the daemon's `targets` reply (`this_machine`, filled from the kind's capability), asked only of
a name other than `local`; what a kind adds to `obd train status` is one table of lines.
"""

from __future__ import annotations

from typing import Any

import pytest

from daemon.cli import render
from daemon.cli.client import DaemonUnreachable
from daemon.cli.common import on_this_machine
from daemon.cli.follow import _Feedback

TARGETS = [
    {"name": "local", "kind": "local", "this_machine": True, "pods": False},
    {"name": "here", "kind": "local", "this_machine": True, "pods": False},
    {"name": "box", "kind": "ssh", "this_machine": False, "pods": False},
    {"name": "pods", "kind": "runpod", "this_machine": False, "pods": True},
]


class Asked:
    """The daemon's `targets`, counting the questions."""

    def __init__(self, answer: list[dict[str, Any]] | Exception) -> None:
        self.answer, self.times = answer, 0

    def __call__(self) -> list[dict[str, Any]]:
        self.times += 1
        if isinstance(self.answer, Exception):
            raise self.answer
        return self.answer


@pytest.mark.parametrize(
    ("target", "here", "asked"),
    [
        pytest.param("local", True, 0, id="local-is-this-machine-without-a-question"),
        pytest.param("here", True, 1, id="another-target-the-daemon-says-is-this-machine"),
        pytest.param("box", False, 1, id="an-ssh-host"),
        pytest.param("pods", False, 1, id="a-pod-target"),
        pytest.param("gone", False, 1, id="a-target-the-daemon-does-not-know"),
    ],
)
def test_whether_a_target_is_this_machine_is_the_daemons_word(target: str, here: bool, asked: int) -> None:
    targets = Asked(TARGETS)
    assert on_this_machine(target, targets) is here
    assert targets.times == asked


def snapshot_record(target: str, remote_dir: str) -> dict[str, Any]:
    return {"id": "r1", "target": target, "remote_dir": remote_dir, "snapshot": {"checkpoint": "output/checkpoint-3"}}


def test_a_waits_checkpoint_size_is_read_only_on_this_machine_and_the_daemon_is_asked_once(tmp_path: Any) -> None:
    checkpoint = tmp_path / "output" / "checkpoint-3"
    checkpoint.mkdir(parents=True)
    (checkpoint / "weights").write_bytes(b"x" * 2048)
    targets = Asked(TARGETS)
    feedback = _Feedback(targets)
    assert feedback._size(snapshot_record("here", str(tmp_path)))
    assert feedback._size(snapshot_record("box", str(tmp_path))) is None
    assert feedback._size(snapshot_record("here", str(tmp_path)))
    assert targets.times == 2  # once per target name


def test_a_daemon_that_does_not_answer_leaves_the_size_out_and_is_asked_again(tmp_path: Any) -> None:
    targets = Asked(DaemonUnreachable("obd: gone"))
    feedback = _Feedback(targets)
    assert feedback._size(snapshot_record("here", str(tmp_path))) is None
    assert feedback._size(snapshot_record("here", str(tmp_path))) is None
    assert targets.times == 2


STATUS = {"id": "r1", "state": "running", "target": "t", "command": ["train"], "history": []}


@pytest.mark.parametrize(
    ("reply", "line"),
    [
        pytest.param(
            {"target_info": {"pod_id": "p1", "phase": "ready"}, "pod": {"state": "RUNNING", "cost_per_hr": 2.0}},
            "pod       p1  RUNNING, $2.00/h",
            id="a-pod",
        ),
        pytest.param(
            {"slurm": {"job_id": "42", "state": "RUNNING", "nodes": "n1"}}, "slurm     job 42 RUNNING on n1", id="slurm"
        ),
    ],
)
def test_what_a_kind_adds_to_the_status_is_its_line_under_its_label(reply: dict[str, Any], line: str) -> None:
    text = render.status({**STATUS, **reply})
    assert line in text.split("\n")
    assert [label for label, _ in render.TARGET_LINES] == ["pod", "slurm"]


def test_a_machine_targets_status_has_no_line_of_another_kind() -> None:
    text = render.status(STATUS)
    assert not [line for line in text.split("\n") if line.startswith(("pod ", "slurm "))]
