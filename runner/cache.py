"""A content-addressed cache of benchmark results: the same inputs never run twice.

The key is the sha256 of a canonical JSON of everything that decides the result: the workload
config (sorted keys), the sha256 of the workload script, of the runner script (`wrap.py`) and of
the trainer plugin's sources (they run inside the job), the ROCm image tag and the step count. Change any byte of them and the key changes. Only live
results are stored; canned (fake) numbers never enter the cache.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from pydantic import BaseModel, ValidationError

from runner.metrics import RunMetrics
from runner.workload import WorkloadConfig


def file_sha256(path: Path) -> str:
    """sha256 of a file's bytes, or "missing:<name>" so a missing script still yields a stable key."""
    digest = hashlib.sha256()
    try:
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
    except OSError:
        return f"missing:{Path(path).name}"
    return digest.hexdigest()


def sources_sha256(directory: Path) -> str:
    """sha256 over the names and bytes of a directory's `*.py` files, in name order."""
    digest = hashlib.sha256()
    for source in sorted(Path(directory).glob("*.py")):
        digest.update(f"{source.name}\0{file_sha256(source)}\0".encode())
    return digest.hexdigest()


class CacheKey(BaseModel):
    """The inputs of one benchmark, and their hash."""

    config: dict
    workload_sha256: str
    runner_sha256: str
    plugin_sha256: str
    rocm_image: str
    steps: int

    def canonical(self) -> bytes:
        return json.dumps(self.model_dump(mode="json"), sort_keys=True, separators=(",", ":")).encode()

    @property
    def digest(self) -> str:
        return hashlib.sha256(self.canonical()).hexdigest()


def cache_key(
    config: WorkloadConfig, steps: int, rocm_image: str, workload_script: Path, runner_script: Path, plugin_dir: Path
) -> CacheKey:
    return CacheKey(
        config=json.loads(config.canonical_json()),
        workload_sha256=file_sha256(workload_script),
        runner_sha256=file_sha256(runner_script),
        plugin_sha256=sources_sha256(plugin_dir),
        rocm_image=rocm_image,
        steps=steps,
    )


class CacheEntry(BaseModel):
    key: CacheKey
    metrics: RunMetrics


class BenchmarkCache:
    """`<directory>/<sha256>.json` files, written atomically."""

    def __init__(self, directory: Path) -> None:
        self.directory = Path(directory)

    def path(self, key: CacheKey) -> Path:
        return self.directory / f"{key.digest}.json"

    def get(self, key: CacheKey) -> RunMetrics | None:
        """The cached live metrics for `key`; None when absent, unreadable, or not what the key says."""
        try:
            entry = CacheEntry.model_validate_json(self.path(key).read_bytes())
        except (OSError, ValidationError, ValueError):
            return None
        if entry.key != key or entry.metrics.runner_kind != "live":
            return None
        return entry.metrics

    def put(self, key: CacheKey, metrics: RunMetrics) -> Path:
        if metrics.runner_kind != "live":
            raise ValueError("only live metrics are cached; canned numbers would pass for measured ones")
        self.directory.mkdir(parents=True, exist_ok=True)
        path = self.path(key)
        tmp = path.with_name(f".{path.name}.tmp.{os.getpid()}")
        tmp.write_text(CacheEntry(key=key, metrics=metrics).model_dump_json(indent=1), encoding="utf-8")
        os.replace(tmp, path)
        return path
