"""Checkpoint retention over SSH (issue 26 item 5): the sizes and the removal run on the host
through jobctl, every word of the command quoted, and never leave the run directory."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from executors.base import ExecutorError
from executors.ssh import SshExecutor


def checkpoint(run_dir: Path, step: int, size: int) -> Path:
    path = run_dir / "output" / f"checkpoint-{step}"
    path.mkdir(parents=True)
    (path / "model.safetensors").write_bytes(b"w" * size)
    (path / "trainer_state.json").write_text(json.dumps({"global_step": step}))
    return path


async def test_a_checkpoint_in_a_run_directory_with_a_hostile_name_is_measured_and_removed_there(
    executor: SshExecutor, workdir: Path, tmp_path: Path
) -> None:
    run_dir = workdir / "run $(touch pwned) 'x' \"y\" `id`;"
    checkpoint(run_dir, 5, 3000)
    checkpoint(run_dir, 10, 100)
    precious = tmp_path / "precious"
    precious.mkdir()
    (run_dir / "output" / "checkpoint-5" / "link").symlink_to(precious)  # removed as a link, not followed
    state = len(json.dumps({"global_step": 5}))
    sizes = await executor.checkpoint_sizes(str(run_dir))
    assert sizes == {"checkpoint-5": 3000 + state, "checkpoint-10": 100 + state + 1}
    assert await executor.remove_checkpoint(str(run_dir), "checkpoint-5") == 3000 + state
    assert sorted(p.name for p in (run_dir / "output").iterdir()) == ["checkpoint-10"]
    assert precious.is_dir() and not list(workdir.rglob("pwned")) and not Path("pwned").exists()


@pytest.mark.parametrize("name", ["../../precious", "checkpoint-5/../..", "precious"])
async def test_a_name_that_is_not_a_checkpoint_is_refused_on_the_host_and_nothing_is_removed(
    executor: SshExecutor, workdir: Path, tmp_path: Path, name: str
) -> None:
    run_dir = workdir / "run"
    checkpoint(run_dir, 5, 10)
    (tmp_path / "precious").mkdir()
    with pytest.raises(ExecutorError):
        await executor.remove_checkpoint(str(run_dir), name)
    assert (tmp_path / "precious").is_dir() and (run_dir / "output" / "checkpoint-5").is_dir()


async def test_an_output_that_is_a_link_out_of_the_run_directory_is_neither_measured_nor_removed(
    executor: SshExecutor, workdir: Path, tmp_path: Path
) -> None:
    elsewhere = tmp_path / "elsewhere"
    checkpoint(elsewhere, 5, 10)
    run_dir = workdir / "run"
    run_dir.mkdir(parents=True)
    (run_dir / "output").symlink_to(elsewhere / "output")
    assert await executor.checkpoint_sizes(str(run_dir)) == {}
    with pytest.raises(ExecutorError):
        await executor.remove_checkpoint(str(run_dir), "checkpoint-5")
    assert (elsewhere / "output" / "checkpoint-5" / "model.safetensors").is_file()
