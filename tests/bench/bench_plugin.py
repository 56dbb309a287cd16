"""What the in-job plugin costs the tiny LoRA workload: its share of a step, measured inside the job, and steps/s with and without it.

    python tests/bench/bench_plugin.py [--steps 200] [--share-reps 3] [--reps 4] [--logging-steps 1]
                                       [--compare DIR ...] [--share-only] [--json]

The share of a step: the workload runs under obd's plugin with every hook of SnapshotCallback
(its `on_*` methods, inherited no-ops included, and its token count: the Trainer's own call per
micro-batch, or a forward pre-hook where the Trainer has none) wrapped in `time.perf_counter_ns`, and so
is obd's wrapper of the Trainer's per-step fetch (`get_batch_samples`, the fetch's own time left out).
Two figures per run:
- `share_pct`: all time inside the hooks during `train()`, plus the CPU time of the plugin's
  threads in that time (the request watch's wake-ups, and the turns of the metrics late
  writer, which writes step logs no step end wrote), over the wall time of `train()` (from the end
  of `on_train_begin` to the start of `on_train_end`). On a loaded machine a hook
  that gets preempted is charged the other process's time slice, so this one reads high there.
- `median_share_pct`: each hook's median call times its number of calls, over the median step
  (time between two `on_step_end`s) times the steps: what a step costs when nothing else
  interferes. Both are ratios of times taken in the same process over the same steps.
Not in either: the Trainer's own dispatch of each event to one more callback before the wrapper
starts, and, where the count is a forward pre-hook, the slower path torch takes to call a module
that has one (measured alone below). An inherited no-op hook shows the floor of any hook, the timer included.

`--compare DIR` also times another copy of the plugin (a `trainer_plugin` directory, e.g. the
last commit's: `git archive HEAD trainer_plugin | tar -x -C /tmp/before`), its runs interleaved
with this one's, so both see the same load: before/after as a ratio. Repeat it to time several in
the same rounds: an old release and a copy of this tree's plugin (`git archive HEAD trainer_plugin`)
give the ratio to the release beside the ratio of two identical plugins, the noise. The threads'
CPU time is split: the request watch, the metrics late writer (a turn when step logs wait), and the
stop points' thread (a look every POLL_SECONDS, interrupt.py).

The with/without comparison (P1, the figure a user sees): runs interleave (without, with, without,
with, ...; with `--compare`, each compared plugin too, the order turning each round) so drift in
machine load hits every side alike; the figure per run is the Trainer's own
train_steps_per_second. On a machine shared with other work, trust the best-run ratio more than
the medians (the load average is printed). The per-call figures time SnapshotCallback's step begin
and end together (no request pending) and on_log in a tight loop, where caches stay warm (a real
step is colder).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
WORKLOAD = REPO / "workloads" / "train_qwen_lora.py"
PLUGIN = REPO / "trainer_plugin"
IN_JOB = "--in-job"
MICRO = "--micro"
DECIDE = "--decide"
# Hooks the Trainer calls once per training, not per step: outside the measured loop.
ONCE_HOOKS = ("on_init_end", "on_train_begin", "on_train_end")
# TrainerCallback's no-ops the Trainer calls every step: what any hook costs here, timer included.
FLOOR_HOOKS = ("on_optimizer_step", "on_epoch_begin")
# obd's wrapper of Trainer.get_batch_samples (where the plugin has one), timed like a hook.
FETCH_WRAPPER = "get_batch_samples wrapper"


def install_plugin(plugin: Path, source: Path = PLUGIN) -> None:
    """Lay the plugin (the `trainer_plugin` directory `source`) out the way obd does in a run directory.

    The package as it is under `plugin/trainer_plugin/` (its rooms `plugin/` and `tools/` where it
    has them), and its `sitecustomize.py` at the top: `plugin/sitecustomize.py` in this layout,
    the package's own in a flat one (a91c419 and before, for `--compare`).
    """
    for path in source.rglob("*.py"):
        if "__pycache__" in path.parts:
            continue
        target = plugin / "trainer_plugin" / path.relative_to(source)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(path, target)
    site = source / "plugin" / "sitecustomize.py"
    shutil.copy2(site if site.is_file() else source / "sitecustomize.py", plugin / "sitecustomize.py")


def plugin_module(name: str) -> Any:
    """The in-job plugin's module `name` of whichever copy is imported: `trainer_plugin.plugin.NAME`,
    or `trainer_plugin.NAME` in a flat copy (a91c419 and before, for `--compare`)."""
    import importlib

    # By the files of the copy imported, not by trying: an editable install's finder would find
    # this tree's `trainer_plugin.plugin` beside a flat copy.
    package = importlib.import_module("trainer_plugin")
    flat = not any((Path(folder) / "plugin" / "__init__.py").is_file() for folder in package.__path__)
    return importlib.import_module(f"trainer_plugin.{name}" if flat else f"trainer_plugin.plugin.{name}")


def run_once(
    root: Path,
    with_plugin: bool,
    steps: int,
    share_file: Path | None = None,
    source: Path = PLUGIN,
    logging_steps: int = 1,
    ranks: int = 1,
) -> float:
    """One workload process (or `ranks` under torchrun, gloo on the CPU); returns its train_steps_per_second.

    With `share_file`, the workload runs under `in_job` (this file), which writes the time spent
    in the plugin's hooks there (rank N > 0 beside it, in `<share_file>.rankN`).
    """
    run = Path(tempfile.mkdtemp(prefix="run-", dir=root))
    env = {k: v for k, v in os.environ.items() if not k.startswith("OBD_") and k != "PYTHONPATH"}
    env["TOKENIZERS_PARALLELISM"] = "false"
    # One intra-op thread: on a small shared machine torch's spinning thread pool, not the
    # plugin, would otherwise decide the figures.
    env.setdefault("OMP_NUM_THREADS", "1")
    if with_plugin:
        install_plugin(run / "plugin", source)
        env.update(
            PYTHONPATH=str(run / "plugin"),
            OBD_RUN_ID="bench",
            OBD_RUN_DIR=str(run),
            OBD_OUTPUT_DIR=str(run / "output"),
        )
    argv = [sys.executable, str(WORKLOAD), "--tiny", "--max_steps", str(steps), "--batch_size", "8"]
    argv += ["--logging_steps", str(logging_steps), "--output_dir", str(run / "mine")]
    if share_file is not None:
        argv[1:1] = [str(Path(__file__).resolve()), IN_JOB, str(share_file)]
    if ranks > 1:
        argv[1:1] = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}"]
    out = subprocess.run(argv, env=env, cwd=run, capture_output=True, text=True, timeout=600, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"workload failed ({out.returncode}):\n{out.stderr[-3000:]}")
    line = next(line for line in out.stdout.splitlines() if line.startswith("train_metrics "))
    if with_plugin and not (run / "metrics.jsonl").exists():
        raise RuntimeError("the plugin did not run (no metrics.jsonl)")
    # Under torchrun the ranks' lines may run together: read the first JSON object only.
    metrics, _end = json.JSONDecoder().raw_decode(line.split(" ", 1)[1])
    return float(metrics["train_steps_per_second"])


def in_job(out: Path, argv: list[str]) -> None:
    """Run the workload `argv` in this process with SnapshotCallback's hooks timed; write the timings to `out`.

    Runs inside the job (the plugin is on PYTHONPATH): every `on_*` hook and the forward
    pre-hook are wrapped on the class before the Trainer makes its callback, so the injected
    callback is the timed one.
    """
    import runpy

    from transformers import TrainerCallback

    SnapshotCallback = plugin_module("callback").SnapshotCallback

    hooks = [
        *sorted(name for name in vars(TrainerCallback) if name.startswith("on_")),
        "_count_forward",
        "_count_inputs",
    ]
    calls: dict[str, list[int]] = {}  # hook -> the duration of each call, ns
    step_ends: list[int] = []  # perf_counter_ns at the start of each on_step_end
    loop: dict[str, int] = {}

    def timed(name: str, original: Any) -> Any:
        durations = calls.setdefault(name, [])

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if name == "on_train_end":
                loop["end"] = time.perf_counter_ns()
            start = time.perf_counter_ns()
            if name == "on_step_end":
                step_ends.append(start)
            try:
                return original(*args, **kwargs)
            finally:
                now = time.perf_counter_ns()
                durations.append(now - start)
                if name == "on_train_begin":
                    loop["begin"] = now

        return wrapper

    for name in hooks:
        if hasattr(SnapshotCallback, name):  # a plugin from before a hook was added (--compare) has not got it
            setattr(SnapshotCallback, name, timed(name, getattr(SnapshotCallback, name)))
    time_fetch_wrapper(calls.setdefault(FETCH_WRAPPER, []))

    # The request watch's thread is plugin time too, on whichever core it runs: the CPU time
    # (thread_time) of each of its wake-ups that ends while training runs (the one that ends it
    # comes at on_train_end, outside, like the thread's start in on_train_begin).
    wakes: list[tuple[int, int]] = []  # (perf_counter_ns at its end, CPU ns)
    watch_class: Any
    try:
        watch_class = plugin_module("request_watch").RequestWatch
    except ImportError:  # a plugin from before the watch (--compare)
        watch_class = None

    if watch_class is not None:
        watch_wake = watch_class._wake

        def timed_wake(self: Any) -> bool:
            cpu = time.thread_time_ns()  # asleep in read() costs no CPU time
            try:
                return watch_wake(self)
            finally:
                wakes.append((time.perf_counter_ns(), time.thread_time_ns() - cpu))

        watch_class._wake = timed_wake

    # The metrics late writer's thread, the same way: the CPU time of each of its turns (a
    # sleep in a wait costs none; a turn that writes overdue step logs costs the write).
    late: list[tuple[int, int]] = []
    MetricsWriter = plugin_module("metrics_file").MetricsWriter

    late_turn = getattr(MetricsWriter, "_late_turn", None)  # a plugin from before it (--compare) has none
    if late_turn is not None:

        def timed_turn(self: Any, condition: Any) -> bool:
            cpu = time.thread_time_ns()
            try:
                return bool(late_turn(self, condition))
            finally:
                late.append((time.perf_counter_ns(), time.thread_time_ns() - cpu))

        setattr(MetricsWriter, "_late_turn", timed_turn)  # noqa: B010 (mypy would refuse the assignment)
    # The stop points' thread (interrupt.py), the same way: the CPU time of each of its looks (every
    # POLL_SECONDS, whatever the steps: counted apart from the late writer's turns).
    looks: list[tuple[int, int]] = []
    try:
        StopPoints = plugin_module("interrupt").StopPoints
    except ImportError:  # a plugin from before it (--compare)
        pass
    else:
        points_turn = StopPoints._turn

        def timed_points_turn(self: Any, now: float) -> None:
            cpu = time.thread_time_ns()
            try:
                points_turn(self, now)
            finally:
                looks.append((time.perf_counter_ns(), time.thread_time_ns() - cpu))

        setattr(StopPoints, "_turn", timed_points_turn)  # noqa: B010 (mypy would refuse the assignment)
    sys.argv = argv
    sys.path[0] = str(Path(argv[0]).resolve().parent)  # as if the workload had been run as a script
    try:
        runpy.run_path(argv[0], run_name="__main__")
    finally:
        rank = int(os.environ.get("RANK", "0"))
        path = out if rank == 0 else out.with_name(f"{out.name}.rank{rank}")
        begin, end = loop.get("begin", 0), loop.get("end", 0)
        inside = [cpu for at, cpu in wakes if begin <= at <= end]
        late_inside = [cpu for at, cpu in late if begin <= at <= end]
        looks_inside = [cpu for at, cpu in looks if begin <= at <= end]
        threads = sum(inside) + sum(late_inside) + sum(looks_inside)
        share = share_of_a_step(calls, step_ends, end - begin, threads, len(inside))
        share.update(watch_thread_us=sum(inside) / 1e3, late_writer_us=sum(late_inside) / 1e3)
        share.update(
            late_turns=len(late_inside), points_thread_us=sum(looks_inside) / 1e3, points_looks=len(looks_inside)
        )
        path.write_text(json.dumps(share))


def time_fetch_wrapper(durations: list[int]) -> None:
    """Time obd's wrapper of Trainer.get_batch_samples (once a step, where a plugin has one), the
    fetch itself left out: its own time goes into `durations`, with the timer's (conservative)."""
    import functools

    inject = plugin_module("inject")
    wrap_fetch = getattr(inject, "_wrap_fetch", None)
    if wrap_fetch is None:  # a plugin from before the wrapper (--compare): the Trainer's own fetch
        return
    inside = [0]

    def timed_wrap_fetch(original: Any) -> Any:
        def fetch(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter_ns()
            try:
                return original(*args, **kwargs)
            finally:
                inside[0] = time.perf_counter_ns() - start

        wrapped = wrap_fetch(fetch)

        @functools.wraps(wrapped)
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter_ns()
            try:
                return wrapped(*args, **kwargs)
            finally:
                durations.append(time.perf_counter_ns() - start - inside[0])

        return timed

    inject._wrap_fetch = timed_wrap_fetch
    trainer = getattr(sys.modules.get("transformers.trainer"), "Trainer", None)
    patched = getattr(trainer, "get_batch_samples", None)
    if trainer is not None and patched is not None and getattr(patched, inject.MARKER, False):  # patched: again, timed
        trainer.get_batch_samples = timed_wrap_fetch(patched.__wrapped__)
        setattr(trainer.get_batch_samples, inject.MARKER, True)


def share_of_a_step(
    calls: dict[str, list[int]], step_ends: list[int], wall_ns: int, thread_ns: int = 0, wakeups: int = 0
) -> dict[str, Any]:
    """The plugin's share of a step from the durations of its hook calls and the CPU time of its threads (see the module's docstring)."""
    per_step = {name: d for name, d in calls.items() if name not in ONCE_HOOKS and d}
    steps = len(calls.get("on_step_end", []))
    in_hooks = sum(sum(d) for d in per_step.values()) + thread_ns
    intervals = [b - a for a, b in itertools.pairwise(step_ends)]
    median_step = statistics.median(intervals) if intervals else 0
    typical = sum(statistics.median(d) * len(d) for d in per_step.values())
    floor = [statistics.median(calls[name]) for name in FLOOR_HOOKS if calls.get(name)]
    return {
        "steps": steps,
        "train_wall_ns": wall_ns,
        "hooks_ns": in_hooks,
        "share_pct": 100.0 * in_hooks / wall_ns if wall_ns > 0 else None,
        "median_share_pct": 100.0 * typical / (median_step * steps) if median_step and steps else None,
        "step_us": wall_ns / steps / 1e3 if steps else None,
        "median_step_us": median_step / 1e3,
        "hooks_us_per_step": in_hooks / steps / 1e3 if steps else None,
        "median_hooks_us_per_step": typical / steps / 1e3 if steps else None,
        "us_per_call": {name: sum(d) / len(d) / 1e3 for name, d in per_step.items()},
        "median_us_per_call": {name: statistics.median(d) / 1e3 for name, d in per_step.items()},
        "calls": {name: len(d) for name, d in per_step.items()},
        "floor_us": min(floor) / 1e3 if floor else None,
        "watch_thread_us": thread_ns / 1e3,  # all the plugin's threads; in_job splits it
        "watch_wakeups": wakeups,
        "late_writer_us": 0.0,
        "late_turns": 0,
        "points_thread_us": 0.0,
        "points_looks": 0,
    }


def plugin_share(
    root: Path, reps: int, steps: int, sources: dict[str, Path], logging_steps: int = 1, ranks: int = 1
) -> dict[str, list[dict[str, Any]]]:
    """`reps` runs of the workload for each plugin in `sources` (name -> trainer_plugin dir), interleaved, hooks timed.

    Each run's figures are rank 0's; under torchrun the other ranks' are in its `other_ranks`.
    """
    results: dict[str, list[dict[str, Any]]] = {name: [] for name in sources}
    for i in range(reps):
        for name, source in sources.items():
            out = root / f"share-{name}-{i}.json"
            run_once(root, True, steps, share_file=out, source=source, logging_steps=logging_steps, ranks=ranks)
            result = json.loads(out.read_text())
            others = [out.with_name(f"{out.name}.rank{rank}") for rank in range(1, ranks)]
            result["other_ranks"] = [json.loads(other.read_text()) for other in others]
            results[name].append(result)
    return results


def pre_hook_dispatch_us(calls: int = 20000) -> float:
    """Microseconds a forward pre-hook like the plugin's token counter adds to one call of a module.

    A module with a hook leaves torch's fast call path; the Trainer calls the top model once per
    micro-batch, so this is paid once per micro-batch.
    """
    import torch

    module = torch.nn.Identity()
    x = torch.zeros(2, 3)

    def call_all() -> float:
        start = time.perf_counter_ns()
        for _ in range(calls):
            module(x)
        return (time.perf_counter_ns() - start) / calls / 1e3

    plain = min(call_all() for _ in range(3))
    handle = module.register_forward_pre_hook(lambda m, args, kwargs: None, with_kwargs=True)
    try:
        hooked = min(call_all() for _ in range(3))
    finally:
        handle.remove()
    return hooked - plain


def micro_costs(calls: int = 20000) -> dict[str, float]:
    """In this process: microseconds per SnapshotCallback.on_step_begin + on_step_end (no request) and per on_log, in a tight loop."""
    from transformers import TrainerControl, TrainerState, TrainingArguments

    SnapshotCallback = plugin_module("callback").SnapshotCallback
    RunEnv = plugin_module("runtime").RunEnv

    with tempfile.TemporaryDirectory() as run:
        callback = SnapshotCallback(env=RunEnv.from_environ({"OBD_RUN_DIR": run}))
        args = TrainingArguments(output_dir=os.path.join(run, "output"), report_to="none")
        state, control = TrainerState(max_steps=10**9), TrainerControl()
        state.global_step = 1
        callback.on_train_begin(args, state, control)
        points = getattr(callback, "_points", None)
        if points is not None and hasattr(points, "fetch_begins"):  # as in a job once its first fetch was seen
            points.fetch_begins(1)
            points.fetch_ended()
        # A step's begin and end, as a job calls them (a plugin whose step begin is TrainerCallback's
        # no-op pays the call, as in a job; a step end without the begin before it takes another path).
        start = time.perf_counter()
        for _ in range(calls):
            callback.on_step_begin(args, state, control)
            callback.on_step_end(args, state, control)
        step_end = time.perf_counter() - start
        logs = {"loss": 1.234, "grad_norm": 0.5, "learning_rate": 2e-4, "epoch": 0.1}
        start = time.perf_counter()
        for _ in range(calls):
            callback.on_log(args, state, control, logs=logs)
        on_log = time.perf_counter() - start
        callback.on_train_end(args, state, control)
    assert not control.should_training_stop
    return {"step_begin_end_us": step_end / calls * 1e6, "on_log_us": on_log / calls * 1e6}


def callback_costs(source: Path = PLUGIN) -> dict[str, float]:
    """micro_costs of the plugin in `source`, in a fresh process that imports that copy."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("OBD_")}
    env["PYTHONPATH"] = str(source.resolve().parent)
    argv = [sys.executable, str(Path(__file__).resolve()), MICRO]
    out = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=600, check=True)
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


def decide_in_job(calls: int = 2000) -> None:
    """Under torchrun: time Ranks.decide (the per-step all-reduce, gloo on the CPU) in lockstep; print rank 0's figures."""
    import torch.distributed as dist

    Ranks = plugin_module("dist").Ranks

    dist.init_process_group("gloo")
    ranks = Ranks()
    durations = []
    for i in range(calls + 200):
        start = time.perf_counter_ns()
        ranks.decide(0, False, 8)
        if i >= 200:  # the first calls set up gloo's connections
            durations.append(time.perf_counter_ns() - start)
    dist.destroy_process_group()
    if ranks.is_zero:
        durations.sort()
        print(
            json.dumps(
                {"median_us": durations[len(durations) // 2] / 1e3, "p90_us": durations[len(durations) * 9 // 10] / 1e3}
            )
        )


def decide_cost(source: Path = PLUGIN, ranks: int = 2) -> dict[str, float]:
    """decide_in_job of the plugin in `source` with `ranks` ranks: what the per-step collective costs when no rank waits for another."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("OBD_")}
    env.update(PYTHONPATH=str(source.resolve().parent), OMP_NUM_THREADS="1")
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}"]
    argv += [str(Path(__file__).resolve()), DECIDE]
    out = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=600, check=True)
    line = next(line for line in out.stdout.splitlines() if line.startswith("{"))
    return dict(json.loads(line))


def summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "runs": runs,
        "share_pct": [r["share_pct"] for r in runs],
        "median_share_pct": [r["median_share_pct"] for r in runs],
        "median_of_share_pct": statistics.median(r["share_pct"] for r in runs),
        "median_of_median_share_pct": statistics.median(r["median_share_pct"] for r in runs),
    }


def compared_names(compare: list[Path]) -> dict[str, Path]:
    """The compared plugins by name: `compare` for one (the name the report and tests know), else `compare1`, `compare2`, ..."""
    if len(compare) == 1:
        return {"compare": compare[0]}
    return {f"compare{i}": path for i, path in enumerate(compare, start=1)}


def benchmark(
    reps: int,
    steps: int,
    share_reps: int = 3,
    compare: list[Path] | None = None,
    logging_steps: int = 1,
    share_only: bool = False,
    ranks: int = 1,
) -> dict[str, Any]:
    root = Path(tempfile.mkdtemp(prefix="obd-bench-"))
    load_before = os.getloadavg()
    sources = {"this": PLUGIN} if not compare else {**compared_names(compare), "this": PLUGIN}
    result: dict[str, Any] = {
        "steps": steps,
        "logging_steps": logging_steps,
        "ranks": ranks,
        "load_average_before": load_before,
    }
    try:
        run_once(root, True, 5)  # warm the page cache for both sides
        shares = plugin_share(root, share_reps, steps, sources, logging_steps, ranks)
        result["share"] = {name: summary(runs) for name, runs in shares.items()}
        result["load_average_after_share"] = os.getloadavg()
        if not share_only:
            result.update(with_without(root, reps, steps, logging_steps, sources))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    result["load_average"] = os.getloadavg()
    result["pre_hook_dispatch_us"] = pre_hook_dispatch_us()
    result["micro"] = {name: callback_costs(source) for name, source in sources.items()}
    if ranks > 1:
        result["decide"] = {name: decide_cost(source, ranks) for name, source in sources.items()}
    return result


def with_without(root: Path, reps: int, steps: int, logging_steps: int, sources: dict[str, Path]) -> dict[str, Any]:
    """The P1 figure: the Trainer's own steps/s without a plugin and with each plugin in `sources`.

    A round runs the workload once without and once with each plugin, in an order that turns by
    one each round, so that a side is not always the one after a cold start or before the machine
    gets busy. Each plugin's figure is its with/without ratio of medians and of best runs (the best
    run of each side is the least disturbed by other load), and `spread_pct` the spread of the
    without runs, the noise any ratio here sits in.
    """
    sides = ["without", *sources]
    runs: dict[str, list[float]] = {side: [] for side in sides}
    for turn in range(reps):
        for side in sides[turn % len(sides) :] + sides[: turn % len(sides)]:
            source = sources.get(side)
            runs[side].append(
                run_once(root, source is not None, steps, source=source or PLUGIN, logging_steps=logging_steps)
            )
    without = runs["without"]
    plugins = {
        name: {
            "steps_per_s": runs[name],
            "median": statistics.median(runs[name]),
            "ratio_with_over_without": statistics.median(runs[name]) / statistics.median(without),
            "best_ratio_with_over_without": max(runs[name]) / max(without),
        }
        for name in sources
    }
    this = plugins["this"]
    return {
        "reps": reps,
        "without_plugin_steps_per_s": without,
        "with_plugin_steps_per_s": this["steps_per_s"],
        "median_without": statistics.median(without),
        "median_with": this["median"],
        "ratio_with_over_without": this["ratio_with_over_without"],
        "best_ratio_with_over_without": this["best_ratio_with_over_without"],
        "spread_pct": 100 * (max(without) - min(without)) / statistics.median(without),
        "with_plugins": plugins,
    }


def ratio_us(before: dict[str, Any], after: dict[str, Any]) -> float:
    """The median over runs of the plugin's µs in a typical step, `after` over `before`."""
    us = [statistics.median(r["median_hooks_us_per_step"] for r in side["runs"]) for side in (before, after)]
    return us[1] / us[0]


def print_report(result: dict[str, Any], opts: argparse.Namespace) -> None:
    def fmt(xs: list[float]) -> str:
        return ", ".join(f"{x:.1f}" for x in xs)

    def loads(xs: list[float]) -> str:
        return ", ".join(f"{x:.1f}" for x in xs)

    where = f"torchrun, {opts.ranks} ranks (gloo, CPU)" if opts.ranks > 1 else "one process"
    print(f"tiny LoRA workload, {opts.steps} steps, a Trainer log every {opts.logging_steps} step(s), {where}")
    compared = compared_names(opts.compare) if opts.compare else {}
    for name, share in result["share"].items():
        label = "this plugin" if name == "this" else f"plugin from {compared[name]}"
        print(f"  {label}: share of a step, measured inside the job ({len(share['runs'])} runs)")
        for run in share["runs"]:
            hooks = ", ".join(f"{hook} {us:.1f}" for hook, us in sorted(run["median_us_per_call"].items()))
            print(
                f"    all time {run['share_pct']:.3f} % ({run['hooks_us_per_step']:.1f} us of a {run['step_us']:.0f} us step); "
                f"typical step {run['median_share_pct']:.3f} % ({run['median_hooks_us_per_step']:.1f} us of "
                f"{run['median_step_us']:.0f} us)"
            )
            print(
                f"      median us per call: {hooks}; no-op floor {run['floor_us']:.1f}; request watch thread "
                f"{run['watch_thread_us']:.0f} us CPU in {run['watch_wakeups']} wake-up(s) while training; "
                f"metrics late writer {run.get('late_writer_us', 0.0):.0f} us CPU in {run.get('late_turns', 0)} turn(s); "
                f"stop points thread {run.get('points_thread_us', 0.0):.0f} us CPU in {run.get('points_looks', 0)} look(s)"
            )
            for rank, other in enumerate(run["other_ranks"], start=1):
                print(
                    f"      rank {rank}: all time {other['share_pct']:.3f} %, typical step "
                    f"{other['median_share_pct']:.3f} %, on_step_end {other['median_us_per_call']['on_step_end']:.1f} us"
                )
        print(
            f"    median: all time {share['median_of_share_pct']:.3f} %, typical step "
            f"{share['median_of_median_share_pct']:.3f} %"
        )
    for name in compared:
        before, after = result["share"][name], result["share"]["this"]
        print(
            f"  this / {compared[name]}: all time "
            f"{after['median_of_share_pct'] / before['median_of_share_pct']:.2f}, typical step "
            f"{after['median_of_median_share_pct'] / before['median_of_median_share_pct']:.2f} "
            f"(µs a typical step: {ratio_us(before, after):.2f})"
        )
    print(
        f"  load average before: {loads(result['load_average_before'])}, after the share runs: "
        f"{loads(result['load_average_after_share'])} on {os.cpu_count()} cores (noisy above 1 per core)"
    )
    print(
        f"  a forward pre-hook (token count) adds {result['pre_hook_dispatch_us']:.2f} us per micro-batch "
        "to torch's call path"
    )
    if "median_with" in result:
        print(f"  {result['reps']} interleaved rounds, the Trainer's own steps/s without and with each plugin:")
        print(
            f"    without plugin: {fmt(result['without_plugin_steps_per_s'])} steps/s "
            f"(median {result['median_without']:.1f}; spread {result['spread_pct']:.1f} % of it)"
        )
        for name, side in result["with_plugins"].items():
            label = "this plugin" if name == "this" else f"plugin from {compared[name]}"
            print(
                f"    with {label}: {fmt(side['steps_per_s'])} steps/s (median {side['median']:.1f}); "
                f"with/without {side['ratio_with_over_without']:.3f} of medians, "
                f"{side['best_ratio_with_over_without']:.3f} of best runs"
            )
    print(f"  load average at the end: {loads(result['load_average'])}")
    for name, micro in result["micro"].items():
        label = "this plugin" if name == "this" else f"plugin from {compared[name]}"
        print(
            f"  {label}, tight loop: on_step_begin + on_step_end with no request {micro['step_begin_end_us']:.2f} us, "
            f"on_log (one metrics.jsonl line) {micro['on_log_us']:.2f} us"
        )
    for name, decide in result.get("decide", {}).items():
        label = "this plugin" if name == "this" else f"plugin from {compared[name]}"
        print(
            f"  {label}, the per-step all-reduce alone ({opts.ranks} ranks in lockstep, gloo): "
            f"median {decide['median_us']:.1f} us, p90 {decide['p90_us']:.1f} us"
        )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--reps", type=int, default=4, help="with/without runs of each side")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--share-reps", type=int, default=3, help="runs that time the plugin's hooks inside the job")
    p.add_argument("--logging-steps", type=int, default=1, help="the workload's --logging_steps (its default: 1)")
    p.add_argument(
        "--compare",
        type=Path,
        action="append",
        help="another trainer_plugin directory to time the same way, interleaved (repeat it for several)",
    )
    p.add_argument("--share-only", action="store_true", help="skip the with/without runs")
    p.add_argument(
        "--ranks", type=int, default=1, help="time the share under torchrun with this many ranks (implies --share-only)"
    )
    p.add_argument("--json", action="store_true")
    opts = p.parse_args()
    for compare in opts.compare or []:
        if not any((compare / d / "callback.py").is_file() for d in ("plugin", ".")):
            p.error(f"--compare {compare}: no callback.py there; give a trainer_plugin directory")
    opts.share_only = opts.share_only or opts.ranks > 1
    result = benchmark(
        opts.reps, opts.steps, opts.share_reps, opts.compare, opts.logging_steps, opts.share_only, opts.ranks
    )
    if opts.json:
        print(json.dumps(result, indent=1))
    else:
        print_report(result, opts)
    return 0


@pytest.mark.bench
def test_the_plugin_costs_the_tiny_workload_little_and_the_step_check_microseconds() -> None:
    result = benchmark(reps=2, steps=150, share_reps=2)
    print(json.dumps(result, indent=1))
    assert result["share"]["this"]["median_of_median_share_pct"] < 1.0
    assert result["micro"]["this"]["step_begin_end_us"] < 500
    assert result["micro"]["this"]["on_log_us"] < 1000
    assert result["ratio_with_over_without"] > 0.8


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == IN_JOB:
        in_job(Path(sys.argv[2]), sys.argv[3:])
        sys.exit(0)
    if len(sys.argv) == 2 and sys.argv[1] == MICRO:
        print(json.dumps(micro_costs()))
        sys.exit(0)
    if len(sys.argv) == 2 and sys.argv[1] == DECIDE:
        decide_in_job()
        sys.exit(0)
    sys.exit(main())
