"""amd-smi telemetry: units by column, preambles, repeated headers, N/A, and `metric --json` shapes."""

from __future__ import annotations

import pytest

from runner import amdsmi


def monitor(path, hint=None) -> amdsmi.Telemetry:
    telemetry = amdsmi.Telemetry()
    amdsmi.read_monitor_csv(path, telemetry, vram_unit_hint=hint)
    return telemetry


def test_default_monitor_csv_reads_vram_in_gb_past_a_preamble_a_repeated_header_and_na(fixtures):
    telemetry = monitor(fixtures / "amdsmi/monitor_default.csv")
    gpu0 = telemetry.gpus["0"]
    assert gpu0.vram_used_gb.count == 3  # the N/A sample is skipped, not read as 0
    assert gpu0.vram_used_gb.high == pytest.approx(62.0)
    assert gpu0.vram_total_gb.high == pytest.approx(191.5)
    assert gpu0.gfx_pct.count == 3 and gpu0.gfx_pct.high == 100
    assert telemetry.vram_units == {"GB"}
    assert telemetry.samples == 7
    assert not telemetry.warnings  # the preamble line comes before the header: skipped silently


def test_monitor_csv_with_dash_v_reads_vram_in_mb(fixtures):
    telemetry = monitor(fixtures / "amdsmi/monitor_verbose.csv")
    gpu0 = telemetry.gpus["0"]
    assert gpu0.vram_used_gb.high == pytest.approx(63488 / 1024)
    assert gpu0.vram_total_gb.high == pytest.approx(196096 / 1024)
    assert telemetry.vram_units == {"MB"}


def test_the_wrappers_unit_hint_decides_when_the_columns_do_not(tmp_path):
    path = tmp_path / "amdsmi_monitor.csv"
    path.write_text("gpu,gfx,vram_used,vram_total\n0,50,2048,196096\n")
    assert monitor(path, hint="MB").gpus["0"].vram_used_gb.high == pytest.approx(2.0)
    assert monitor(path).gpus["0"].vram_used_gb.high == pytest.approx(2048.0)  # no hint, no -v columns: GB


def test_a_unit_written_in_the_cell_wins_over_the_column_default(tmp_path):
    path = tmp_path / "amdsmi_monitor.csv"
    path.write_text("gpu,gfx,vram_used,vram_total\n0,50 %,512 MB,192.0 GB\n")
    gpu = monitor(path).gpus["0"]
    assert gpu.vram_used_gb.high == pytest.approx(0.5)
    assert gpu.vram_total_gb.high == pytest.approx(192.0)
    assert gpu.gfx_pct.high == 50


def test_power_usage_is_never_read_as_utilisation(tmp_path):
    path = tmp_path / "amdsmi_monitor.csv"
    path.write_text("gpu,power_usage,vram_used,vram_total\n0,750,10.0,191.5\n0,740,12.0,191.5\n")
    telemetry = monitor(path)
    summary = amdsmi.summarise(telemetry)
    assert summary.gpu_util_pct is None
    assert summary.power_avg_w == pytest.approx(745)


def test_idle_gpus_of_a_multi_gpu_box_do_not_dilute_the_averages(fixtures):
    summary = amdsmi.summarise(monitor(fixtures / "amdsmi/monitor_default.csv"))
    assert summary.active_gpus == ["0"]
    assert summary.hbm_peak_gb == pytest.approx(62.0)
    assert summary.hbm_avg_gb == pytest.approx((60.5 + 62.0 + 61.0) / 3)
    assert summary.gpu_util_pct == pytest.approx((97 + 100 + 95) / 3)


def test_metric_json_of_rocm_6_is_a_list_after_a_warning_preamble(fixtures):
    telemetry = amdsmi.Telemetry()
    amdsmi.read_metric_json(fixtures / "amdsmi/metric_rocm6.json", telemetry)
    gpu0 = telemetry.gpus["0"]
    assert gpu0.vram_used_gb.high == pytest.approx(61952 / 1024)
    assert gpu0.gfx_pct.high == 97
    assert gpu0.power_w.high == 305
    assert not telemetry.warnings


def test_metric_json_of_rocm_7_wraps_gpus_in_gpu_data_and_tolerates_na_sections(fixtures):
    telemetry = amdsmi.Telemetry()
    amdsmi.read_metric_json(fixtures / "amdsmi/metric_rocm7.json", telemetry)
    assert telemetry.gpus["0"].vram_used_gb.high == pytest.approx(63488 / 1024)
    assert telemetry.gpus["1"].vram_used_gb.count == 0  # "mem_usage": "N/A"
    assert telemetry.gpus["1"].power_w.count == 0


def test_the_wrappers_metric_jsonl_samples_are_read_one_line_each(tmp_path, fixtures):
    import json

    document = json.loads((fixtures / "amdsmi/metric_rocm7.json").read_text())
    path = tmp_path / "amdsmi_metric.jsonl"
    path.write_text(
        "".join(json.dumps({"time": 1.0 + i, "data": document}) + "\n" for i in range(3)) + '{"time": 4, "da'
    )
    telemetry = amdsmi.Telemetry()
    amdsmi.read_metric_json(path, telemetry)
    assert telemetry.gpus["0"].gfx_pct.count == 3
    assert any("1 unreadable JSON lines" in w for w in telemetry.warnings)


def test_metric_json_documents_written_one_after_another_are_each_read(tmp_path, fixtures):
    # Two polls of `amd-smi metric --json` appended to one file, each indented over many lines,
    # the second cut off by the end of the run.
    text = (fixtures / "amdsmi/metric_rocm6.json").read_text().rstrip("\n") + "\n"
    body = text[text.index("[") :]
    path = tmp_path / "amdsmi_metric.json"
    path.write_text(text + body + body[: len(body) // 2])
    telemetry = amdsmi.Telemetry()
    amdsmi.read_metric_json(path, telemetry)
    assert telemetry.gpus["0"].gfx_pct.count == 2
    assert telemetry.gpus["0"].vram_used_gb.high == pytest.approx(61952 / 1024)
    assert any("unreadable JSON lines" in w for w in telemetry.warnings)
