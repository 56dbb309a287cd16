"""In-job profiling with torch.profiler, for machines without rocprofv3 (NVIDIA, CPU, ROCm without it).

Runs inside the training job (standard library, torch imported lazily), so it imports nothing
from obd. The obd Trainer callback drives it when `OBD_TORCH_PROFILE=1`; custom loops can too:

    prof = StepProfiler(os.environ["OBD_PROFILE_DIR"])
    for step in ...:
        prof.step_begin(step); train_step(); prof.step_end(step)
    prof.close()

It profiles a bounded window of steps (skip `wait`, warm up for `warmup`, record `active`), then
stops the profiler so the rest of the run pays nothing, and writes into the profile directory:
`torch_kernels.csv` (name, calls, total_us, device: the window's kernels and operators by self
time) and `torch_profile.json` (step times of every step, the wait between steps, peak memory,
the device). Step timing continues after the window. Nothing here ever raises into training.
"""

from __future__ import annotations

import contextlib
import csv
import io
import json
import os
import sys
import time
from typing import Any

FORMAT_VERSION = 1
KERNELS_FILE = "torch_kernels.csv"
PROFILE_FILE = "torch_profile.json"
MAX_RECORDED_STEPS = 2000  # per-step records kept in the JSON; the summary covers every step


class _Stats:
    """Count, sum, min and max of a series of seconds, without keeping the series."""

    def __init__(self) -> None:
        self.count = 0
        self.total = 0.0
        self.low: float | None = None
        self.high: float | None = None

    def add(self, value: float) -> None:
        self.count += 1
        self.total += value
        self.low = value if self.low is None else min(self.low, value)
        self.high = value if self.high is None else max(self.high, value)

    def as_dict(self) -> dict:
        return {
            "count": self.count,
            "total_s": self.total,
            "mean_s": self.total / self.count if self.count else None,
            "min_s": self.low,
            "max_s": self.high,
        }


def _atomic_write(path: str, data: str) -> None:
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(data)
    os.replace(tmp, path)


def _rank_dir(profile_dir: str) -> str:
    """Rank 0 writes into the profile directory itself, other ranks into `rank<N>/` beside it."""
    rank = os.environ.get("RANK") or "0"
    return profile_dir if rank in ("", "0") else os.path.join(profile_dir, f"rank{rank}")


class StepProfiler:
    """Profile steps `wait + warmup` to `wait + warmup + active - 1` (counted from the first step seen)."""

    def __init__(self, profile_dir: str, wait: int = 1, warmup: int = 1, active: int = 3) -> None:
        self.profile_dir = _rank_dir(profile_dir)
        self.wait, self.warmup, self.active = max(0, int(wait)), max(0, int(warmup)), max(1, int(active))
        self.errors: list[str] = []
        self.state = "idle"  # idle -> profiling -> done; "off" when torch or the profiler fails
        self._torch: Any = None  # the torch module, once the window starts
        self._prof: Any = None  # the torch.profiler.profile under way
        self._profiled_calls = 0
        self._window: list[int] = []
        self._steps: list[dict] = []
        self._period = _Stats()  # step_begin to the next step_begin
        self._inner = _Stats()  # step_begin to step_end
        self._gap = _Stats()  # step_end to the next step_begin: batch fetch and trainer overhead
        self._window_inner = _Stats()
        # The same two series over steps the profiler did not touch (its start, trace processing
        # and stop slow the steps around the window): the undisturbed pace of the run.
        self._clean_period = _Stats()
        self._clean_gap = _Stats()
        self._last_step_profiled = False
        self._last_begin: float | None = None
        self._last_end: float | None = None
        self._pending_gap: float | None = None
        self._begin_step: int | None = None
        self._first_step: int | None = None
        self._last_step: int | None = None
        self._device_time_us: float | None = None
        self._kernel_rows = 0
        self._model: dict = {}
        self._closed = False
        try:
            os.makedirs(self.profile_dir, exist_ok=True)
        except OSError as exc:
            self._fail(f"cannot create {self.profile_dir}: {exc}")

    # --- the hooks -----------------------------------------------------------------------

    def step_begin(self, step: int) -> None:
        try:
            now = time.perf_counter()
            clean = not self._last_step_profiled and self.state != "profiling"
            if self._last_begin is not None:
                self._period.add(now - self._last_begin)
                if clean:
                    self._clean_period.add(now - self._last_begin)
            self._pending_gap = None if self._last_end is None else now - self._last_end
            if self._pending_gap is not None:
                self._gap.add(self._pending_gap)
                if clean:
                    self._clean_gap.add(self._pending_gap)
            self._last_begin = now
            self._begin_step = step
            if self._first_step is None:
                self._first_step = step
            if self.state == "idle":
                self._start()
        except Exception as exc:
            self._fail(f"step_begin: {type(exc).__name__}: {exc}")

    def step_end(self, step: int) -> None:
        try:
            in_window = self.state == "profiling"
            self._last_step_profiled = in_window
            if in_window and self._cuda():
                self._torch.cuda.synchronize()  # only inside the window: the step's real duration
            now = time.perf_counter()
            inner = now - self._last_begin if self._last_begin is not None else None
            if inner is not None:
                self._inner.add(inner)
            self._last_end = now
            self._last_step = step
            if len(self._steps) < MAX_RECORDED_STEPS:
                self._steps.append({"step": step, "seconds": inner, "wait_before_s": self._pending_gap})
            if in_window:
                self._profiled_calls += 1
                if self._profiled_calls > self.wait + self.warmup:
                    self._window.append(step)
                    if inner is not None:
                        self._window_inner.add(inner)
                self._prof.step()
                if self.state == "done" or self._profiled_calls >= self.wait + self.warmup + self.active:
                    self._stop()
        except Exception as exc:
            self._fail(f"step_end: {type(exc).__name__}: {exc}")

    def note_model(self, model: object) -> None:
        """Record the parameter counts (all and trainable) that MFU needs; optional."""
        try:
            params = trainable = 0
            for p in model.parameters():  # type: ignore[attr-defined]
                n = p.numel()
                params += n
                trainable += n if p.requires_grad else 0
            self._model = {"params": params, "trainable_params": trainable}
        except Exception as exc:
            self.errors.append(f"note_model: {type(exc).__name__}: {exc}")

    def close(self) -> None:
        """Stop profiling if still on and write the final `torch_profile.json`; safe to call twice."""
        if self._closed:
            return
        self._closed = True
        try:
            if self.state == "profiling":
                self.errors.append(
                    f"the run ended after {self._profiled_calls} profiled steps, before the window "
                    f"of {self.wait}+{self.warmup}+{self.active} completed"
                )
                self._stop()
        except Exception as exc:
            self._fail(f"close: {type(exc).__name__}: {exc}")
        self._write_summary()

    # --- internals -----------------------------------------------------------------------

    def _cuda(self) -> bool:
        return self._torch is not None and self._torch.cuda.is_available()

    def _start(self) -> None:
        try:
            import torch  # lazily: the plugin must load where torch is absent
            from torch.profiler import ProfilerActivity, profile, schedule
        except Exception as exc:
            self._fail(f"torch.profiler unavailable: {type(exc).__name__}: {exc}")
            return
        self._torch = torch
        activities = [ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(ProfilerActivity.CUDA)  # HIP kernels too on ROCm builds
        self._prof = profile(
            activities=activities,
            schedule=schedule(wait=self.wait, warmup=self.warmup, active=self.active, repeat=1),
            on_trace_ready=self._on_trace_ready,
            record_shapes=False,
            profile_memory=False,
            with_stack=False,
        )
        self._prof.start()
        self.state = "profiling"

    def _stop(self) -> None:
        prof, self._prof = self._prof, None
        self.state = "done" if self.state != "off" else "off"
        if prof is not None:
            prof.stop()
        self._write_summary()

    def _on_trace_ready(self, prof: object) -> None:
        try:
            self._write_kernels(prof)
        except Exception as exc:
            self.errors.append(f"kernel table: {type(exc).__name__}: {exc}")
        self.state = "done"

    def _write_kernels(self, prof: object) -> None:
        rows = []
        device_total = 0.0
        for event in prof.key_averages():  # type: ignore[attr-defined]
            name = event.key
            if name.startswith("ProfilerStep"):
                continue  # the step wrapper: its self time is the Python between operators
            device_us = float(getattr(event, "self_device_time_total", 0.0) or 0.0)
            is_device = "CPU" not in str(getattr(event, "device_type", "CPU"))
            if is_device and device_us > 0:
                rows.append((name, event.count, device_us, "gpu"))
                device_total += device_us
            elif not is_device:
                cpu_us = float(getattr(event, "self_cpu_time_total", 0.0) or 0.0)
                if cpu_us > 0:
                    rows.append((name, event.count, cpu_us, "cpu"))
        rows.sort(key=lambda r: -r[2])
        buffer = io.StringIO()
        writer = csv.writer(buffer)
        writer.writerow(["name", "calls", "total_us", "device"])
        for name, calls, total_us, device in rows:
            writer.writerow([name, calls, f"{total_us:.3f}", device])
        _atomic_write(os.path.join(self.profile_dir, KERNELS_FILE), buffer.getvalue())
        self._kernel_rows = len(rows)
        self._device_time_us = device_total if device_total > 0 else None

    def _fail(self, message: str) -> None:
        self.errors.append(message)
        prof, self._prof = self._prof, None
        self.state = "off"
        if prof is not None:
            with contextlib.suppress(Exception):
                prof.stop()

    def _device(self) -> dict:
        torch: Any = self._torch
        if torch is None:
            try:
                import torch
            except Exception:
                return {"kind": "unknown", "torch_version": None}
        info: dict = {
            "torch_version": torch.__version__,
            "hip_version": getattr(torch.version, "hip", None),
            "cuda_version": getattr(torch.version, "cuda", None),
        }
        if torch.cuda.is_available():
            info["kind"] = "rocm" if info["hip_version"] else "cuda"
            info["count"] = torch.cuda.device_count()
            try:
                info["name"] = torch.cuda.get_device_name()
                info["peak_memory_allocated_bytes"] = torch.cuda.max_memory_allocated()
                info["peak_memory_reserved_bytes"] = torch.cuda.max_memory_reserved()
                info["total_memory_bytes"] = torch.cuda.get_device_properties(0).total_memory
            except Exception as exc:
                self.errors.append(f"device memory: {type(exc).__name__}: {exc}")
        else:
            info["kind"] = "cpu"
            info["count"] = 0
        return info

    def _write_summary(self) -> None:
        try:
            summary = {
                "version": FORMAT_VERSION,
                "time": time.time(),
                "state": self.state,
                "window": {
                    "wait": self.wait,
                    "warmup": self.warmup,
                    "active": self.active,
                    "profiled_steps": self._window,
                },
                "device": self._device(),
                "host_peak_rss_bytes": _peak_rss(),
                "steps": {
                    "first": self._first_step,
                    "last": self._last_step,
                    "period": self._period.as_dict(),
                    "in_step": self._inner.as_dict(),
                    "wait_between": self._gap.as_dict(),
                    "window_in_step": self._window_inner.as_dict(),
                    "period_unprofiled": self._clean_period.as_dict(),
                    "wait_between_unprofiled": self._clean_gap.as_dict(),
                },
                "device_time_per_window_step_s": (
                    self._device_time_us / 1e6 / len(self._window) if self._device_time_us and self._window else None
                ),
                "kernel_rows": self._kernel_rows,
                "step_records": self._steps,
                "model": self._model,
                "rank": os.environ.get("RANK"),
                "world_size": os.environ.get("WORLD_SIZE"),
                "errors": self.errors,
            }
            _atomic_write(os.path.join(self.profile_dir, PROFILE_FILE), json.dumps(summary, indent=1))
        except Exception as exc:
            print(f"obd torch_profile: could not write the summary: {exc}", file=sys.stderr)


def _peak_rss() -> int | None:
    try:
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    except Exception:
        return None
