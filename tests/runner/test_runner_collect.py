"""collect_metrics: fetch through the executor, parse, and never raise."""

from __future__ import annotations

import shutil
from pathlib import Path

from runner.collect import collect_metrics


class CopyExecutor:
    """An executor whose target is a local directory: `download` copies a file or a tree."""

    name = "copy"
    workdir = "/"

    def __init__(self, fail_download: bool = False) -> None:
        self.fail_download = fail_download
        self.reads = 0

    async def download(self, remote: str, local: Path) -> None:
        if self.fail_download:
            raise OSError("connection reset")
        source = Path(remote)
        if source.is_dir():
            shutil.copytree(source, local)
        elif source.is_file():
            shutil.copyfile(source, local)

    async def read_from(self, path: str, offset: int, limit: int) -> bytes:
        self.reads += 1
        try:
            with open(path, "rb") as f:
                f.seek(offset)
                return f.read(limit)
        except OSError:
            return b""


async def test_collect_downloads_profile_and_metrics_and_returns_a_json_able_dict(fixtures, tmp_path):
    result = await collect_metrics(CopyExecutor(), str(fixtures / "run_o_name"), tmp_path / "collected")
    assert result["runner_kind"] == "live"
    assert result["steps"] == 4 and result["dispatch_count"] == 28
    assert (tmp_path / "collected" / "profile" / "rocprof" / "run1_kernel_trace.csv").is_file()
    assert isinstance(result["waste_budget"], dict)


async def test_collect_when_downloads_fail_reads_metrics_in_chunks_and_warns_about_the_profile(fixtures, tmp_path):
    executor = CopyExecutor(fail_download=True)
    result = await collect_metrics(executor, str(fixtures / "run_o_name"), tmp_path / "collected")
    assert executor.reads >= 1
    assert result["steps"] == 4  # from metrics.jsonl, read with read_from
    assert result["warnings"][0].startswith("profile/ could not be downloaded")
    assert result["top_kernels"] == []


async def test_collect_of_a_run_that_left_nothing_says_what_is_missing(tmp_path):
    (tmp_path / "remote").mkdir()
    result = await collect_metrics(CopyExecutor(), str(tmp_path / "remote"), tmp_path / "collected")
    assert any("no profile/ directory" in w for w in result["warnings"])
    assert any("metrics.jsonl is missing" in w for w in result["warnings"])
    assert result["tokens_per_sec"] is None


async def test_collect_never_raises_even_for_a_broken_executor(tmp_path):
    result = await collect_metrics(object(), "/remote/run", tmp_path / "collected")
    assert result["runner_kind"] == "live" and result["warnings"]


class DeadExecutor(CopyExecutor):
    """A target that went away (a pod terminated after its outputs were retrieved)."""

    async def download(self, remote: str, local: Path) -> None:
        raise OSError("no route to host")

    async def read_from(self, path: str, offset: int, limit: int) -> bytes:
        raise OSError("no route to host")


async def test_a_collect_from_a_target_that_is_gone_keeps_and_parses_the_copy_retrieved_earlier(fixtures, tmp_path):
    local = tmp_path / "retrieved"
    shutil.copytree(fixtures / "run_o_name" / "profile", local / "profile")
    shutil.copyfile(fixtures / "run_o_name" / "metrics.jsonl", local / "metrics.jsonl")
    before = sorted(p.relative_to(local) for p in local.rglob("*"))
    result = await collect_metrics(DeadExecutor(), "/gone/run", local)
    assert sorted(p.relative_to(local) for p in local.rglob("*")) == before  # nothing deleted
    assert result["steps"] == 4 and result["dispatch_count"] == 28  # measured from the earlier copy
    assert any("the copy retrieved earlier is used" in w for w in result["warnings"])
