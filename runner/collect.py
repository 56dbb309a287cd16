"""After a profiled run ends: fetch `profile/` and `metrics.jsonl` through the executor and parse them.

The same code serves local, SSH and pod targets, because it only uses the executor's `download`
and `read_from`. It never raises: what could not be fetched or parsed becomes a warning in the
returned metrics, and the run's record keeps whatever was measured.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import anyio

from runner.assemble import parse_run
from runner.metrics import RunMetrics
from trainer_plugin.rundir import RunPaths

log = logging.getLogger(__name__)

READ_CHUNK = 1 << 20
METRICS_LIMIT = 256 * 1024 * 1024  # a metrics.jsonl larger than this is read no further


async def collect_metrics(executor, remote_dir: str, local_dir: Path) -> dict:
    """Download the run's profile into `local_dir`, parse it, return `RunMetrics.model_dump(mode="json")`."""
    warnings: list[str] = []
    try:
        local_dir = Path(local_dir)
        local_dir.mkdir(parents=True, exist_ok=True)
        local, there = RunPaths(local_dir), RunPaths(remote_dir)
        profile_local = Path(local.profile)
        metrics_local = Path(local.metrics)
        await _fetch_profile(executor, there.profile, profile_local, warnings)
        await _fetch_metrics(executor, there.metrics, metrics_local, warnings)
        # Parsing a large trace takes seconds of CPU: keep it off the daemon's event loop.
        metrics = await anyio.to_thread.run_sync(
            parse_run,
            profile_local if profile_local.is_dir() else None,
            metrics_local if metrics_local.is_file() else None,
        )
    except Exception as exc:  # the record must get metrics, even if only the failure
        log.exception("collecting metrics from %s failed", remote_dir)
        metrics = RunMetrics()
        metrics.warn(f"metrics could not be collected ({type(exc).__name__}: {exc})")
    for warning in reversed(warnings):
        if warning not in metrics.warnings:
            metrics.warnings.insert(0, warning)
    return metrics.model_dump(mode="json")


async def _fetch_profile(executor, remote: str, local: Path, warnings: list[str]) -> None:
    """Download into a staging directory and swap it in only when it came: a copy retrieved
    earlier (a pod's verified outputs) is never destroyed by a download that fails."""
    staging = local.with_name(f".{local.name}.collecting")
    shutil.rmtree(staging, ignore_errors=True)
    try:
        await executor.download(remote, staging)
    except Exception as exc:  # executors raise their own errors; any is a gap, not a crash
        shutil.rmtree(staging, ignore_errors=True)
        kept = "; the copy retrieved earlier is used" if local.is_dir() else ""
        warnings.append(f"profile/ could not be downloaded from the target ({type(exc).__name__}: {exc}){kept}")
        return
    if staging.is_dir():
        shutil.rmtree(local, ignore_errors=True)  # a stale copy from an earlier collect would mix in
        staging.rename(local)
    elif not local.is_dir():
        warnings.append("the target has no profile/ directory: the wrapper did not run, or wrote nothing")


async def _fetch_metrics(executor, remote: str, local: Path, warnings: list[str]) -> None:
    """Download (or read in chunks) into a staging file, swapped in only when something came."""
    staging = local.with_name(f".{local.name}.collecting")
    staging.unlink(missing_ok=True)
    try:
        await executor.download(remote, staging)
        if staging.is_file():
            staging.replace(local)
            return
    except Exception:  # fall back to reading it in chunks
        pass
    try:
        offset = 0
        async with await anyio.open_file(staging, "wb") as out:
            while offset < METRICS_LIMIT:
                chunk = await executor.read_from(remote, offset, READ_CHUNK)
                if not chunk:
                    break
                await out.write(chunk)
                offset += len(chunk)
        if offset == 0:
            staging.unlink(missing_ok=True)
            return
        staging.replace(local)
        if offset >= METRICS_LIMIT:
            warnings.append(f"metrics.jsonl is larger than {METRICS_LIMIT >> 20} MiB: read only its start")
    except Exception as exc:  # any failure of the target is a warning: the copy retrieved earlier stays
        staging.unlink(missing_ok=True)
        kept = "; the copy retrieved earlier is used" if local.is_file() else ""
        warnings.append(f"metrics.jsonl could not be read from the target ({type(exc).__name__}: {exc}){kept}")
