"""Runners: the fake one is canned and says so everywhere; the live one measures, caches, and fails loudly."""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

import pytest

import runner
from runner.cache import BenchmarkCache, cache_key
from runner.format import format_metrics
from runner.metrics import RunMetrics
from runner.runners import FakeRunner, LiveRunner, RunnerFailed, choose_scenario, get_runner, load_scenarios
from runner.workload import WorkloadConfig

SCENARIOS = Path(runner.__file__).resolve().parents[1] / "workloads" / "synthetic"


def test_every_shipped_scenario_is_valid_and_self_consistent():
    scenarios = load_scenarios(SCENARIOS)
    assert {s.name for s, _ in scenarios} >= {"default"}
    for scenario, path in scenarios:
        metrics = RunMetrics.model_validate(scenario.metrics)
        assert metrics.runner_kind == "fake", path
        assert sum(k.pct_time for k in metrics.top_kernels) + metrics.other_kernels_pct == pytest.approx(100), path
        assert metrics.waste_budget.known_total() == pytest.approx(metrics.waste_budget.step_time_s), path


def test_the_most_specific_matching_scenario_is_chosen():
    scenarios = load_scenarios(SCENARIOS)
    pick = lambda **kw: choose_scenario(WorkloadConfig(**kw), scenarios)[0].name  # noqa: E731
    assert pick(model="Qwen/Qwen2.5-0.5B-Instruct", method="lora", gpu="MI300X") == "Qwen2.5-0.5B LoRA on one MI300X"
    assert pick(model="Qwen/Qwen2.5-0.5B", method="lora", gpu="mi300x") == "Qwen2.5-0.5B LoRA on one MI300X"
    assert pick(attention="eager") == "Eager (unfused) attention"
    assert pick(model="meta-llama/Llama-3.2-1B", gpu="MI250X") == "default"


def test_ties_between_equally_specific_scenarios_go_to_the_first_name(tmp_path):
    for name in ("b_second", "a_first"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "scenario.json").write_text(
            json.dumps({"name": name, "match": {"precision": "bf16"}, "metrics": {"steps": 1}})
        )
    assert choose_scenario(WorkloadConfig(), load_scenarios(tmp_path))[0].name == "a_first"


def test_the_fake_runner_marks_its_numbers_fake_in_the_metrics_the_sources_the_warnings_and_the_text():
    metrics = FakeRunner(SCENARIOS).run(WorkloadConfig(attention="eager"), steps=50)
    assert metrics.runner_kind == "fake" and metrics.profiler == "fake"
    assert metrics.warnings[0].startswith("FAKE: canned numbers")
    assert all(
        text.startswith("fake: canned scenario") for key, text in metrics.sources.items() if key != "scenario_match"
    )
    dumped = metrics.model_dump(mode="json")
    assert dumped["runner_kind"] == "fake"
    text = format_metrics(dumped)
    assert text.splitlines()[0].startswith("runner_kind: fake")
    assert text.rstrip().splitlines()[-1].startswith("runner_kind: fake")
    assert "NOTHING WAS MEASURED" in text


def test_the_fake_runner_is_only_used_when_asked_for_by_name(tmp_path):
    assert isinstance(get_runner("fake"), FakeRunner)
    assert isinstance(get_runner("live", work_dir=tmp_path), LiveRunner)
    with pytest.raises(ValueError):
        get_runner("auto")  # type: ignore[arg-type]
    assert isinstance(get_runner("fake"), runner.Runner)


def test_a_failing_live_run_raises_with_its_log_and_never_returns_canned_numbers(tmp_path):
    failing = lambda config, steps, python: [python, "-c", "import sys; print('boom'); sys.exit(4)"]  # noqa: E731
    live = LiveRunner(work_dir=tmp_path, command_builder=failing)
    with pytest.raises(RunnerFailed, match="status 4") as info:
        live.run(WorkloadConfig(), steps=2)
    log = Path(str(info.value).rsplit(" ", 1)[-1])
    assert log.name == "job.log" and "boom" in log.read_text()


TINY_WORKLOAD = """
import json, os, time
path = os.environ["OBD_METRICS_FILE"]
t = time.time()
lines = [{"event": "begin", "time": t, "max_steps": 3, "snapshots": True, "start_step": 0, "world_size": 1}]
lines += [{"event": "log", "time": t + s, "step": s, "tokens": 1000 * s} for s in (1, 2, 3)]
open(path, "w").write("".join(json.dumps(l) + "\\n" for l in lines))
"""


def test_a_live_run_is_measured_once_and_then_served_from_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("OBD_ROCPROFV3", "")
    monkeypatch.setenv("OBD_AMD_SMI", "")
    monkeypatch.setenv("OBD_KFD_TOPOLOGY", str(tmp_path / "none"))
    calls = []

    def builder(config, steps, python):
        calls.append(steps)
        return [python, "-c", TINY_WORKLOAD]

    cache = BenchmarkCache(tmp_path / "cache")
    live = LiveRunner(work_dir=tmp_path / "runs", cache=cache, command_builder=builder, rocm_image="rocm/pytorch:test")
    first = live.run(WorkloadConfig(), steps=3)
    assert first.runner_kind == "live" and first.steps == 3
    assert first.tokens_per_sec == pytest.approx(1000.0)
    second = live.run(WorkloadConfig(), steps=3)
    assert calls == [3]
    assert second.tokens_per_sec == first.tokens_per_sec and "benchmark cache" in second.sources["cache"]


LAYOUT_PROBE = """
import importlib.util, json, os, sys, sitecustomize, trainer_plugin
first = os.environ["PYTHONPATH"].split(os.pathsep)[0]
found = {"first": first, "sitecustomize": sitecustomize.__file__, "trainer_plugin": trainer_plugin.__file__,
         "top_level": [m for m in ("runtime", "dist", "loop", "inject", "callback", "jobctl", "rundir")
                       if importlib.util.find_spec(m) is not None],
         "listing": sorted(n for n in os.listdir(first) if n != "__pycache__"),
         "package": sorted(os.listdir(os.path.join(first, "trainer_plugin")))}
open("layout.json", "w").write(json.dumps(found))
path = os.environ["OBD_METRICS_FILE"]
open(path, "w").write(json.dumps({"event": "begin", "time": 1.0, "max_steps": 1, "start_step": 0}) + "\\n")
"""


def test_the_live_job_gets_a_plugin_dir_laid_out_like_the_daemons_first_on_its_pythonpath(tmp_path, monkeypatch):
    monkeypatch.setenv("OBD_ROCPROFV3", "")
    monkeypatch.setenv("OBD_AMD_SMI", "")
    monkeypatch.setenv("OBD_KFD_TOPOLOGY", str(tmp_path / "none"))
    live = LiveRunner(
        work_dir=tmp_path / "runs", command_builder=lambda config, steps, python: [python, "-c", LAYOUT_PROBE]
    )
    metrics = live.run(WorkloadConfig(), steps=1)
    run_dir = Path(metrics.sources["run_dir"])
    found = json.loads((run_dir / "layout.json").read_text())
    plugin = run_dir / "plugin"
    assert Path(found["first"]) == plugin
    assert Path(found["sitecustomize"]).resolve() == (plugin / "sitecustomize.py").resolve()
    assert Path(found["trainer_plugin"]).resolve() == (plugin / "trainer_plugin" / "__init__.py").resolve()
    assert found["top_level"] == []  # the plugin's modules are not top-level names in the job
    assert set(found["listing"]) == {"trainer_plugin", "sitecustomize.py", *(p.name for p in runner.TARGET_FILES)}
    assert set(found["package"]) >= {"__init__.py", "rundir.py", "plugin", "tools"}  # the package, both rooms
    assert json.loads((run_dir / "profile" / "runner.json").read_text())  # the wrapper ran, from plugin/


# A training job that outlives its wrapper's kill: it starts a worker (standing in for the
# trainer under rocprofv3) that ignores SIGTERM, and both write their pid and then sleep.
STUBBORN_JOB = '''
import os, subprocess, sys, time
worker = """
import os, signal, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
open("worker.pid.tmp", "w").write(str(os.getpid()))
os.rename("worker.pid.tmp", "worker.pid")
time.sleep(300)
"""
open("job.pid", "w").write(str(os.getpid()))
subprocess.Popen([sys.executable, "-c", worker])
time.sleep(300)
'''


def _running(pid: int) -> bool:
    """The process exists and is not a zombie (a zombie holds no GPU, only its exit status)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def test_a_live_run_that_times_out_leaves_no_process_of_the_workload_behind(tmp_path, monkeypatch):
    monkeypatch.setenv("OBD_ROCPROFV3", "")
    monkeypatch.setenv("OBD_AMD_SMI", "")
    monkeypatch.setenv("OBD_KFD_TOPOLOGY", str(tmp_path / "none"))
    live = LiveRunner(
        work_dir=tmp_path / "runs",
        timeout_s=5,
        kill_grace_s=0.5,
        command_builder=lambda config, steps, python: [python, "-c", STUBBORN_JOB],
    )
    pids: list[int] = []
    try:
        with pytest.raises(RunnerFailed, match="ran past 5 s") as info:
            live.run(WorkloadConfig(), steps=1)
        run_dir = Path(str(info.value).rsplit(" ", 1)[-1]).parent
        pids = [int((run_dir / name).read_text()) for name in ("job.pid", "worker.pid")]
        assert [pid for pid in pids if _running(pid)] == []
        assert (run_dir / "job.log").is_file()
    finally:
        for pid in pids:  # without the fix they would sleep on: end them here
            if _running(pid):
                os.kill(pid, signal.SIGKILL)


def test_the_cache_key_changes_with_each_of_its_inputs(tmp_path):
    script, wrapper, plugin = tmp_path / "train.py", tmp_path / "wrap.py", tmp_path / "plugin"
    script.write_text("print(1)")
    wrapper.write_text("print(2)")
    plugin.mkdir()
    (plugin / "callback.py").write_text("STEP = 1")

    def key(config=None, steps=10, image="img:1"):
        return cache_key(config or WorkloadConfig(), steps, image, script, wrapper, plugin).digest

    base = key()
    assert key() == base
    assert key(config=WorkloadConfig(seq_len=1024)) != base
    assert key(steps=11) != base
    assert key(image="img:2") != base
    script.write_text("print(1) ")
    assert key() != base
    script.write_text("print(1)")
    wrapper.write_text("print(3)")
    assert key() != base
    wrapper.write_text("print(2)")
    assert key() == base
    # The plugin runs inside the job: a change to any of its sources is a new benchmark.
    (plugin / "callback.py").write_text("STEP = 2")
    assert key() != base
    (plugin / "callback.py").write_text("STEP = 1")
    (plugin / "dist.py").write_text("")
    assert key() != base


def test_the_cache_refuses_fake_metrics_and_ignores_corrupt_entries(tmp_path):
    cache = BenchmarkCache(tmp_path)
    key = cache_key(WorkloadConfig(), 1, "img", Path(sys.executable), Path(sys.executable), tmp_path)
    with pytest.raises(ValueError):
        cache.put(key, RunMetrics(runner_kind="fake"))
    cache.put(key, RunMetrics(steps=1))
    hit = cache.get(key)
    assert hit is not None and hit.steps == 1
    cache.path(key).write_text("{not json")
    assert cache.get(key) is None


def test_the_default_command_refuses_settings_the_workload_script_cannot_apply():
    from runner.runners import default_command

    argv = default_command(WorkloadConfig(seq_len=64, args=["--tiny"]), 5, "python3")
    assert argv[2:] == [
        "--model",
        "Qwen/Qwen2.5-0.5B",
        "--max_steps",
        "5",
        "--seq_len",
        "64",
        "--batch_size",
        "1",
        "--precision",
        "bf16",
        "--output_dir",
        "output",
        "--lora_rank",
        "16",
        "--tiny",
    ]
    with pytest.raises(ValueError, match="attention"):
        default_command(WorkloadConfig(attention="eager"), 5, "python3")


@pytest.mark.slow
def test_a_live_run_of_the_tiny_qwen_workload_on_the_cpu_measures_steps_and_tokens(tmp_path, monkeypatch):
    """The real workload script (--tiny: offline, CPU) under the wrapper and the obd plugin; ~20 s."""
    pytest.importorskip("peft")
    for name, value in (("OBD_ROCPROFV3", ""), ("OBD_AMD_SMI", ""), ("OBD_KFD_TOPOLOGY", str(tmp_path / "none"))):
        monkeypatch.setenv(name, value)
    config = WorkloadConfig(args=["--tiny"], precision="fp32", seq_len=64, batch_size=4)
    metrics = LiveRunner(work_dir=tmp_path).run(config, steps=4)
    assert metrics.runner_kind == "live"
    assert metrics.steps == 4
    assert metrics.tokens_per_sec and metrics.tokens_per_sec > 0
    assert any("OBD_TORCH_PROFILE=1" in w for w in metrics.warnings)
