"""Retrieval from an SSH target never follows a symbolic link out of the run directory (issue 11.1).

Inside a downloaded tree a link is kept as a link only when its target is relative with no `..`
(so it can only point further down the tree); any other link is skipped. A path that is a link,
or is reached through one below the workdir, is refused and nothing is copied.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from executors.base import LinkRefused
from executors.ssh import SshExecutor
from tests.executors.ssh.helpers import make_target
from tests.sshd import SshServer


def escapes(root: Path) -> list[str]:
    """Every entry under `root` (the local copy) that resolves to somewhere outside it."""
    real_root = root.resolve()
    out = []
    for path in root.rglob("*"):
        if not path.resolve().is_relative_to(real_root):
            out.append(f"{path.relative_to(root)} -> {os.readlink(path) if path.is_symlink() else path.resolve()}")
    return out


@pytest.fixture
def outside(tmp_path: Path) -> Path:
    """A directory outside the workdir with something private in it."""
    secret = tmp_path / "elsewhere"
    (secret / "checkpoint-5").mkdir(parents=True)
    (secret / "checkpoint-5" / "private.key").write_text("not yours")
    (secret / "private.key").write_text("not yours either")
    return secret


async def test_links_in_output_to_etc_or_up_are_not_downloaded_as_what_they_point_at(
    executor: SshExecutor, workdir: Path, tmp_path: Path, outside: Path
) -> None:
    out = workdir / "run" / "output"
    (out / "checkpoint-1").mkdir(parents=True)
    (out / "checkpoint-1" / "adapter.bin").write_bytes(b"w" * 100)
    (out / "etc").symlink_to("/etc")
    (out / "up").symlink_to("..")
    (out / "checkpoint-1" / "sneaky").symlink_to("../../../..")
    (out / "key").symlink_to(outside / "private.key")
    (out / "latest").symlink_to("checkpoint-1")  # points further down the tree: kept as a link
    local = tmp_path / "back" / "output"
    await executor.download(str(out), local)
    assert (local / "checkpoint-1" / "adapter.bin").read_bytes() == b"w" * 100
    assert escapes(local.parent) == []
    for name in ("etc", "up", "key", "checkpoint-1/sneaky"):
        assert not (local / name).exists() and not (local / name).is_symlink(), name
    assert os.readlink(local / "latest") == "checkpoint-1"
    assert not any(p.name == "private.key" for p in tmp_path.joinpath("back").rglob("*"))


async def test_a_checkpoint_reached_through_a_linked_output_is_refused_and_nothing_is_copied(
    executor: SshExecutor, workdir: Path, tmp_path: Path, outside: Path
) -> None:
    run = workdir / "run"
    run.mkdir(parents=True)
    (run / "output").symlink_to(outside)  # output/checkpoint-5 is really elsewhere/checkpoint-5
    local = tmp_path / "back" / "checkpoint-5"
    with pytest.raises(LinkRefused, match="symbolic link"):
        await executor.download(str(run / "output" / "checkpoint-5"), local)
    with pytest.raises(LinkRefused, match="symbolic link"):
        await executor.download(str(run / "output" / "private.key"), tmp_path / "back" / "key")
    assert not (tmp_path / "back").exists()


async def test_a_path_that_is_itself_a_link_is_refused(
    executor: SshExecutor, workdir: Path, tmp_path: Path, outside: Path
) -> None:
    out = workdir / "run" / "output"
    out.mkdir(parents=True)
    (out / "checkpoint-5").symlink_to(outside / "checkpoint-5")
    with pytest.raises(LinkRefused, match="is a symbolic link"):
        await executor.download(str(out / "checkpoint-5"), tmp_path / "back")
    assert not (tmp_path / "back").exists() and not (tmp_path / "back").is_symlink()


async def test_a_workdir_that_is_itself_behind_a_link_still_downloads(shared_sshd: SshServer, tmp_path: Path) -> None:
    real = tmp_path / "disk" / "obd"
    (real / "run" / "output").mkdir(parents=True)
    (real / "run" / "output" / "adapter.bin").write_bytes(b"ok")
    (tmp_path / "home-obd").symlink_to(real)  # e.g. a home directory on another disk
    ex = SshExecutor("box", make_target(shared_sshd, tmp_path / "home-obd"))
    try:
        await ex.download(str(tmp_path / "home-obd" / "run" / "output"), tmp_path / "back")
    finally:
        await ex.aclose()
    assert (tmp_path / "back" / "adapter.bin").read_bytes() == b"ok"
