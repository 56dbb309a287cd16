"""What the daemon takes from the user's carry helper (daemon/service/carry_local.py) before it
writes it on a target with the target's account: that helper is the user's process, so its
stream is as hostile as its owner. No process: the header check, row by row."""

from __future__ import annotations

import pytest

from daemon.service.carry_local import CarryRefused, stream_entry


@pytest.mark.parametrize(
    "path",
    ["../../home/bob/.ssh/authorized_keys", "/etc/cron.d/x", "a/../../b", "a//b", "./a", "a/", ""],
)
def test_a_path_from_the_users_helper_that_leaves_the_checkpoint_is_refused(path: str) -> None:
    with pytest.raises(CarryRefused, match="not a path inside the checkpoint"):
        stream_entry({"path": path, "size": 1, "mode": 0o600})


def test_a_negative_size_is_refused() -> None:
    with pytest.raises(CarryRefused, match="a size of -1 bytes"):
        stream_entry({"path": "model.safetensors", "size": -1})


def test_a_files_mode_keeps_only_its_permission_bits() -> None:
    assert stream_entry({"path": "sub/model.bin", "size": 3, "mode": 0o4755}) == ("sub/model.bin", 3, 0o755)
    assert stream_entry({"path": "trainer_state.json", "size": 0}) == ("trainer_state.json", 0, 0o600)
