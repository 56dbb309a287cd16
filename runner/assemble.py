"""Turn a profile directory and `metrics.jsonl` into `RunMetrics`, saying where each number came from.

The order of preference is fixed: rocprofv3's kernel traces (CSV, else its rocpd SQLite databases,
else a counter collection with timestamps), else rocprofv3's kernel stats, else the torch.profiler
table; counter totals from `counter_collection.csv` whenever there is one; amd-smi for memory and utilisation; `metrics.jsonl` for step time and
tokens. Each reader reports what it skipped; this module turns that into warnings and never
raises for bad input. A missing input leaves its numbers `None`.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from runner import amdsmi, hardware, kernels, nvsmi, rocpd, rocprof, steps, torchprof
from runner.discover import ProfileFiles, find_profile_files
from runner.metrics import RunMetrics
from runner.waste import BudgetInputs, waste_budget
from runner.workload import WorkloadConfig

TOP_KERNELS = 10


def parse_run(
    profile_dir: Path | None, metrics_file: Path | None = None, workload: WorkloadConfig | None = None
) -> RunMetrics:
    """RunMetrics of one run from its `profile/` directory and its `metrics.jsonl` (either may be missing)."""
    metrics = RunMetrics(runner_kind="live")
    try:
        _parse_into(metrics, profile_dir, metrics_file, workload)
    except Exception as exc:  # a parser bug must not lose the run's record
        metrics.warn(
            f"internal error while parsing the profile ({type(exc).__name__}: {exc}); "
            "the numbers above it may be incomplete"
        )
    return metrics


def _parse_into(
    metrics: RunMetrics, profile_dir: Path | None, metrics_file: Path | None, workload: WorkloadConfig | None
) -> None:
    files = find_profile_files(profile_dir) if profile_dir is not None else None
    if profile_dir is None or files is None or not profile_dir.is_dir():
        metrics.warn("no profile directory: the run was not profiled, or profile/ was not retrieved")
    runner_info = _read_runner_json(files, metrics) if files else {}
    log = steps.read_metrics_jsonl(metrics_file) if metrics_file is not None else steps.StepLog()
    pace = steps.pace(log)
    metrics.steps, metrics.step_time_s, metrics.tokens_per_sec = pace.steps, pace.step_time_s, pace.tokens_per_sec
    metrics.sources.update(pace.sources)

    torch_summary = None
    if files and files.torch_summary:
        torch_summary = torchprof.read_torch_summary(
            files.torch_summary, metrics.warnings, files.label(files.torch_summary)
        )
        metrics.files.append(files.label(files.torch_summary))

    busy_per_step, category_ns, busy_source = _kernels(metrics, files, pace.steps, torch_summary)
    agents = _agents(metrics, files)
    telemetry = _telemetry(metrics, files, runner_info)
    _torch_fields(metrics, torch_summary, telemetry)
    _versions(metrics, runner_info, torch_summary)
    _mfu(metrics, log, pace.world_size, agents, torch_summary, workload)

    data_wait = torch_summary.wait_between_s if torch_summary else None
    step_time = metrics.step_time_s
    if step_time is None and torch_summary and torch_summary.period_s:
        step_time = torch_summary.period_s
        metrics.step_time_s = step_time
        metrics.sources["step_time_s"] = "torch_profile.json: mean time from one step_begin to the next"
    budget = waste_budget(
        BudgetInputs(
            step_time_s=step_time,
            busy_s=busy_per_step,
            category_ns=category_ns,
            data_wait_s=data_wait,
            hbm_peak_gb=metrics.hbm_peak_gb,
            hbm_total_gb=metrics.hbm_total_gb,
            busy_source=busy_source,
            data_source="torch_profile.json: mean wall time from step_end to the next step_begin "
            "(batch fetch and trainer overhead)",
            gpu=metrics.device_kind != "cpu",
        )
    )
    metrics.waste_budget = budget.budget
    metrics.sources.update(budget.sources)
    for warning in pace.warnings + budget.warnings:
        metrics.warn(warning)
    if files is not None and profile_dir is not None and profile_dir.is_dir() and not files.any_profile():
        metrics.warn(
            "profile/ holds no profiler output (no kernel trace, kernel stats, torch.profiler table or amd-smi samples)"
        )


def _read_runner_json(files: ProfileFiles, metrics: RunMetrics) -> dict:
    """The wrapper's account of the run: what was missing, what it ran, what it found."""
    if files.runner_json is None:
        return {}
    try:
        info = json.loads(files.runner_json.read_text(encoding="utf-8", errors="replace"))
    except (OSError, ValueError, RecursionError) as exc:
        metrics.warn(f"runner.json unreadable ({exc})")
        return {}
    if not isinstance(info, dict):
        return {}
    metrics.files.append(files.label(files.runner_json))
    for note in info.get("notes") or []:
        if isinstance(note, str):
            metrics.warn(f"wrapper: {note}")
    return info


def _kernels(
    metrics: RunMetrics,
    files: ProfileFiles | None,
    step_count: int | None,
    torch_summary: torchprof.TorchSummary | None,
) -> tuple[float | None, dict, str]:
    """Top kernels, attention, and the GPU busy time per step with its split by bucket."""
    if files is None:
        return None, {}, ""
    totals: dict[str, tuple[int, float]] = {}
    busy_per_step: float | None = None
    busy_source = ""
    counters = _counters(metrics, files)
    trace, kind = _dispatches(metrics, files, counters)
    if trace is not None:
        for warning in trace.warnings:
            metrics.warn(warning)
        if trace.bad_rows or trace.csv_errors:
            metrics.warn(
                f"{kind}: {trace.bad_rows + trace.csv_errors} unreadable rows skipped "
                "(cut-off lines, N/A or negative durations)"
            )
        if kind != "counter collections":  # their files are listed once, by _counters
            metrics.files.extend(trace.files)
        if trace.dispatches:
            totals = trace.totals()
            metrics.profiler, metrics.device_kind = "rocprofv3", "amd"
            metrics.dispatch_count = trace.dispatches
            metrics.kernel_time_s = trace.kernel_ns / 1e9
            busy = [ns for ns in trace.busy_ns.values() if ns > 0]
            metrics.gpu_busy_s = sum(busy) / len(busy) / 1e9 if busy else None
            if busy:
                metrics.gpu_count = len(busy)
                metrics.sources["gpu_count"] = f"{kind}: GPU agents that ran kernels"
            layouts = ", ".join(sorted(set(trace.layouts)))
            where = (
                f"{len(trace.files)} {kind.removesuffix('s')} file(s), {trace.dispatches} dispatches; layout: {layouts}"
            )
            metrics.sources["top_kernels"] = f"rocprofv3 {where}; % of summed kernel durations"
            metrics.sources["gpu_busy_s"] = "union of kernel intervals per GPU agent, mean over agents"
            if step_count and metrics.gpu_busy_s is not None:
                busy_per_step = metrics.gpu_busy_s / step_count
                busy_source = f"{kind} busy time / {step_count} steps, whole process"
        elif trace.files:
            metrics.warn(f"{kind} hold no kernel dispatches")
    if not totals and files.kernel_stats:
        for path in files.kernel_stats:
            for name, (calls, ns) in rocprof.read_kernel_stats(path, metrics.warnings, files.label(path)).items():
                prev_calls, prev_ns = totals.get(name, (0, 0.0))
                totals[name] = (prev_calls + calls, prev_ns + ns)
            metrics.files.append(files.label(path))
        if totals:
            metrics.profiler, metrics.device_kind = "rocprofv3", "amd"
            metrics.kernel_time_s = sum(ns for _, ns in totals.values()) / 1e9
            metrics.dispatch_count = sum(calls for calls, _ in totals.values())
            metrics.sources["top_kernels"] = "rocprofv3 kernel_stats.csv (no kernel trace); % of TotalDurationNs"
            metrics.warn("no kernel trace: GPU busy time and the busy buckets of the waste budget are unknown")
    if not totals and counters is not None and counters.calls:
        # Counters without timestamps (rocprofv3 before ROCm 7): which kernels ran and how often, not for how long.
        metrics.profiler, metrics.device_kind = "rocprofv3", "amd"
        metrics.dispatch_count = counters.dispatches
        metrics.kernel_count = len(counters.calls)
        metrics.attention_kernel_loaded, metrics.attention_kernels = kernels.attention_evidence(list(counters.calls))
        metrics.warn(
            "counter_collection.csv without timestamps and no kernel trace: kernel times and GPU busy time "
            "are unknown (add --kernel-trace to rocprofv3's options)"
        )
    if not totals and files.torch_kernels:
        table = torchprof.read_torch_kernels(files.torch_kernels, files.label(files.torch_kernels))
        for warning in table.warnings:
            metrics.warn(warning)
        metrics.files.append(files.label(files.torch_kernels))
        window = len(torch_summary.window_steps) if torch_summary else 0
        if table.gpu:
            totals = table.gpu
            metrics.sources["top_kernels"] = (
                f"torch.profiler: GPU kernels of {window} profiled steps, by self device time"
            )
        elif table.cpu:
            totals = table.cpu
            metrics.sources["top_kernels"] = (
                f"torch.profiler: CPU operators of {window} profiled steps, by self CPU "
                "time (no GPU: these are operators, not kernels)"
            )
        if totals:
            metrics.profiler = "torch.profiler"
            metrics.kernel_time_s = sum(ns for _, ns in totals.values()) / 1e9
            metrics.dispatch_count = sum(calls for calls, _ in totals.values())
            if table.gpu and torch_summary and torch_summary.device_time_per_step_s:
                busy_per_step = torch_summary.device_time_per_step_s
                busy_source = f"torch.profiler device time per profiled step ({window} steps)"
    if not totals:
        return None, {}, ""
    metrics.top_kernels, metrics.other_kernels_pct = kernels.kernel_shares(totals, TOP_KERNELS)
    metrics.kernel_count = len(totals)
    metrics.attention_kernel_loaded, metrics.attention_kernels = kernels.attention_evidence(list(totals))
    metrics.sources["attention_kernel_loaded"] = (
        "kernel names: fused attention (flash, CK fmha, efficient SDPA, Triton attn) "
        + ("found" if metrics.attention_kernel_loaded else "not found among " + f"{len(totals)} names")
    )
    category_ns: dict = {}
    for name, (calls, ns) in totals.items():
        bucket = kernels.classify(name, calls, ns)
        category_ns[bucket] = category_ns.get(bucket, 0.0) + ns
    return busy_per_step, category_ns, busy_source


def _counters(metrics: RunMetrics, files: ProfileFiles) -> rocprof.CounterCollection | None:
    """Every `counter_collection.csv`: each counter's total over the run's dispatches into `metrics.counters`."""
    if not files.counter_collections:
        return None
    counters = rocprof.CounterCollection()
    for path in files.counter_collections:
        rocprof.read_counter_collection(path, counters, files.label(path))
    for warning in counters.warnings:
        metrics.warn(warning)
    metrics.files.extend(counters.files)
    if counters.counters:
        metrics.counters = dict(sorted(counters.counters.items()))
        metrics.sources["counters"] = (
            f"rocprofv3 counter collection ({len(counters.files)} file(s)): each counter summed over "
            f"{counters.dispatches} dispatches"
        )
    return counters


def _dispatches(
    metrics: RunMetrics, files: ProfileFiles, counters: rocprof.CounterCollection | None
) -> tuple[rocprof.KernelTrace | None, str]:
    """The run's kernel dispatches and what they were read from, best source first.

    CSV kernel traces, else the rocpd databases (rocprofv3 writes the same dispatches to both when
    asked for both formats, so only one is read), else a counter collection with timestamps.
    """
    if files.kernel_traces:
        trace = rocprof.KernelTrace()
        for path in files.kernel_traces:
            rocprof.read_kernel_trace(path, trace, files.label(path))
        kind = "kernel traces"
        if files.rocpd_dbs:
            metrics.sources["rocpd"] = "rocpd database(s) not read: the CSV kernel traces hold the same dispatches"
    elif files.rocpd_dbs:
        trace = rocprof.KernelTrace()
        for path in files.rocpd_dbs:
            rocpd.read_kernels(path, trace, files.label(path))
        kind = "rocpd databases"
    elif counters is not None and counters.timed:
        trace, kind = counters.trace, "counter collections"
    else:
        return None, ""
    trace.finish()
    return trace, kind


def _agents(metrics: RunMetrics, files: ProfileFiles | None) -> list[rocprof.GpuAgent]:
    agents: list[rocprof.GpuAgent] = []
    if files is None:
        return agents
    seen: set[tuple[str, str]] = set()
    for path in files.agent_infos:
        for agent in rocprof.read_agent_info(path, metrics.warnings, files.label(path)):
            key = (agent.node_id, agent.product)
            if key not in seen:  # one agent_info.csv per process: the same GPUs again
                seen.add(key)
                agents.append(agent)
        metrics.files.append(files.label(path))
    where = "agent_info.csv"
    if not agents and files.rocpd_dbs:
        for path in files.rocpd_dbs:
            for agent in rocpd.read_agents(path, metrics.warnings, files.label(path)):
                key = (agent.node_id, agent.product)
                if key not in seen:  # one database per process: the same GPUs again
                    seen.add(key)
                    agents.append(agent)
        where = "rocpd database (rocpd_info_agent)"
    if agents:
        metrics.gpu_name = agents[0].product or agents[0].name
        metrics.sources["gpu_name"] = f"{where} ({len(agents)} GPU(s) on the node)"
    return agents


def _telemetry(metrics: RunMetrics, files: ProfileFiles | None, runner_info: dict) -> amdsmi.TelemetrySummary | None:
    if files is not None and files.nvidia_smi and not (files.amdsmi_csv or files.amdsmi_json):
        return _nvidia_telemetry(metrics, files)
    if files is None or not (files.amdsmi_csv or files.amdsmi_json):
        return None
    telemetry = amdsmi.Telemetry()
    sampler = runner_info.get("amd_smi")
    if not isinstance(sampler, dict):
        sampler = {}
    hint = sampler.get("vram_unit") if isinstance(sampler.get("vram_unit"), str) else None
    for path in files.amdsmi_csv:
        amdsmi.read_monitor_csv(path, telemetry, files.label(path), vram_unit_hint=hint)
    for path in files.amdsmi_json:
        amdsmi.read_metric_json(path, telemetry, files.label(path))
    for warning in telemetry.warnings:
        metrics.warn(warning)
    metrics.files.extend(telemetry.files)
    if not telemetry.samples:
        metrics.warn("amd-smi output holds no samples: HBM and utilisation unknown")
        return None
    summary = amdsmi.summarise(telemetry)
    units = "/".join(sorted(telemetry.vram_units)) or "?"
    where = (
        f"amd-smi ({', '.join(telemetry.files)}): {telemetry.samples} samples of GPU(s) "
        f"{', '.join(summary.active_gpus)}"
    )
    _apply_telemetry(
        metrics,
        summary,
        memory=f"{where}; max vram_used (read in {units}, shown in GB of 1024 MB)",
        memory_avg=f"{where}; mean vram_used",
        util=f"{where}; mean graphics activity (the gfx column, not power)",
        power=f"{where}; mean power_usage",
        tool="amd-smi",
    )
    if metrics.device_kind is None:
        metrics.device_kind = "amd"
    return summary


def _nvidia_telemetry(metrics: RunMetrics, files: ProfileFiles) -> amdsmi.TelemetrySummary | None:
    """NVML's samples (the wrapper's nvidia-smi loop) as HBM, utilisation and power."""
    telemetry = amdsmi.Telemetry()
    for path in files.nvidia_smi:
        nvsmi.read_query_csv(path, telemetry, files.label(path))
    for warning in telemetry.warnings:
        metrics.warn(warning)
    metrics.files.extend(telemetry.files)
    if not telemetry.samples:
        metrics.warn("nvidia-smi output holds no samples: HBM and utilisation unknown")
        return None
    summary = amdsmi.summarise(telemetry)
    where = (
        f"nvidia-smi, NVML ({', '.join(telemetry.files)}): {telemetry.samples} samples of GPU(s) "
        f"{', '.join(summary.active_gpus)}"
    )
    _apply_telemetry(
        metrics,
        summary,
        memory=f"{where}; max memory.used of the GPU, every process on it (MiB, shown in GB of 1024 MiB)",
        memory_avg=f"{where}; mean memory.used",
        util=f"{where}; mean utilization.gpu (the share of each sample period in which a kernel ran) "
        "from the job's start to its end, start-up included",
        power=f"{where}; mean power.draw",
        tool="nvidia-smi",
    )
    return summary


def _apply_telemetry(
    metrics: RunMetrics,
    summary: amdsmi.TelemetrySummary,
    memory: str,
    memory_avg: str,
    util: str,
    power: str,
    tool: str,
) -> None:
    """Put a vendor tool's summary into the metrics, each number with its source."""
    memory_word = "VRAM" if tool == "amd-smi" else "memory"  # each tool's own word
    metrics.hbm_peak_gb, metrics.hbm_avg_gb = summary.hbm_peak_gb, summary.hbm_avg_gb
    metrics.hbm_total_gb, metrics.gpu_util_pct, metrics.power_avg_w = (
        summary.hbm_total_gb,
        summary.gpu_util_pct,
        summary.power_avg_w,
    )
    if summary.hbm_peak_gb is not None:
        metrics.sources["hbm_peak_gb"] = memory
        metrics.sources["hbm_avg_gb"] = memory_avg
    else:
        metrics.warn(f"{tool} samples carry no {memory_word} figures: HBM unknown")
    if summary.gpu_util_pct is not None:
        metrics.sources["gpu_util_pct"] = util
    if summary.power_avg_w is not None:
        metrics.sources["power_avg_w"] = power
    if metrics.gpu_count is None and summary.active_gpus:
        metrics.gpu_count = len(summary.active_gpus)
        metrics.sources["gpu_count"] = f"{tool}: GPUs whose {memory_word} or activity moved during the run"


def _torch_fields(
    metrics: RunMetrics, summary: torchprof.TorchSummary | None, telemetry: amdsmi.TelemetrySummary | None
) -> None:
    if summary is None:
        return
    for error in summary.errors:
        metrics.warn(f"torch.profiler: {error}")
    if metrics.device_kind is None and summary.device_kind in ("cpu", "cuda", "rocm"):
        metrics.device_kind = summary.device_kind
    if metrics.profiler == "none":
        metrics.profiler = "torch.profiler"
    if metrics.gpu_name is None and summary.device_name:
        metrics.gpu_name = summary.device_name
        metrics.sources["gpu_name"] = "torch_profile.json: torch.cuda.get_device_name()"
    if summary.device_kind == "cpu":
        metrics.warn("CPU run: no GPU, so HBM, GPU utilisation, MFU and the GPU buckets do not apply")
        return
    if telemetry is None and summary.peak_reserved_bytes is not None:
        # Only the allocator's reservation is known: a lower bound of what the process used.
        metrics.hbm_peak_gb = summary.peak_reserved_bytes / 1024**3
        metrics.sources["hbm_peak_gb"] = (
            "torch_profile.json: torch.cuda.max_memory_reserved() of the profiling "
            "rank (the caching allocator's peak, not the whole process)"
        )
        if summary.total_memory_bytes:
            metrics.hbm_total_gb = summary.total_memory_bytes / 1024**3
        metrics.warn("HBM average and GPU utilisation unknown: no amd-smi or nvidia-smi samples on this path")


def _versions(metrics: RunMetrics, runner_info: dict, summary: torchprof.TorchSummary | None) -> None:
    rocm = runner_info.get("rocm_version")
    if isinstance(rocm, str) and rocm:
        metrics.rocm_version = rocm
        metrics.sources["rocm_version"] = "runner.json: the target's /opt/rocm/.info/version"
    elif summary and summary.hip_version:
        metrics.rocm_version = summary.hip_version
        metrics.sources["rocm_version"] = "torch_profile.json: torch.version.hip"
    if summary and summary.torch_version:
        metrics.pytorch_version = summary.torch_version
        metrics.sources["pytorch_version"] = "torch_profile.json: torch.__version__ inside the job"
    else:
        torch_version = runner_info.get("pytorch_version")
        if isinstance(torch_version, str) and torch_version:
            metrics.pytorch_version = torch_version
            metrics.sources["pytorch_version"] = "runner.json: torch.__version__ of the wrapper's Python"


def _positive(value: object) -> bool:
    """A finite number above zero (JSON booleans, NaN and infinity are not)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0


def _mfu(
    metrics: RunMetrics,
    log: steps.StepLog,
    world_size: int | None,
    agents: list[rocprof.GpuAgent],
    summary: torchprof.TorchSummary | None,
    workload: WorkloadConfig | None,
) -> None:
    if metrics.device_kind == "cpu":
        return
    peak = None
    if agents:
        agent = agents[0]
        peak = hardware.peak_from_agent(
            agent.name or hardware.gfx_name(agent.gfx_target_version), agent.cu_count, agent.max_clock_mhz, agent.source
        )
        peak = peak or hardware.peak_from_name(agent.product)
    peak = peak or hardware.peak_from_name(metrics.gpu_name)
    if peak is None and workload and workload.gpu:
        peak = hardware.peak_from_name(workload.gpu)
    if peak is not None:
        metrics.peak_tflops = peak.tflops
        metrics.sources["peak_tflops"] = peak.source

    begin = log.begin or {}
    flops, flops_source = None, ""
    if _positive(begin.get("flops_per_token")):
        flops, flops_source = float(begin["flops_per_token"]), "metrics.jsonl begin line: flops_per_token"
    elif _positive(begin.get("model_params")):
        trainable = begin.get("trainable_params")
        flops = hardware.flops_per_token(begin["model_params"], trainable if _positive(trainable) else None)
        flops_source = "metrics.jsonl begin line: model_params, trainable_params"
    elif summary and summary.model_params:
        flops = hardware.flops_per_token(summary.model_params, summary.trainable_params)
        flops_source = "torch_profile.json: parameter counts"
    elif workload and workload.model_params:
        flops = hardware.flops_per_token(workload.model_params, workload.trainable_params)
        flops_source = "workload config: model_params"
    if flops is not None:
        metrics.flops_per_token = flops
        metrics.sources["flops_per_token"] = f"{flops_source}; 4N + 2 x trainable parameters"

    if world_size:
        metrics.gpu_count = world_size
        metrics.sources["gpu_count"] = "metrics.jsonl begin line: world_size"
    gpus = metrics.gpu_count
    metrics.mfu_pct = hardware.mfu_pct(metrics.tokens_per_sec, flops, metrics.peak_tflops, gpus)
    if metrics.mfu_pct is not None:
        metrics.sources["mfu_pct"] = (
            f"tokens/s x {flops:.3g} FLOPs/token / ({metrics.peak_tflops:.1f} TFLOPs x {gpus} GPU(s))"
        )
        return
    missing = [
        what
        for what, value in (
            ("tokens/s", metrics.tokens_per_sec),
            ("model FLOPs per token", flops),
            ("GPU peak", metrics.peak_tflops),
            ("GPU count", gpus),
        )
        if not value
    ]
    metrics.warn("MFU unknown: no " + ", no ".join(missing))
