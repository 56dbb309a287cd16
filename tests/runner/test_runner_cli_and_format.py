"""`obd profile parse` and the text of `obd train metrics`."""

from __future__ import annotations

import json
import subprocess
import sys

from runner.cli import profile_parse_main
from runner.format import format_metrics
from runner.metrics import RunMetrics


def test_profile_parse_without_a_directory_or_with_an_unknown_option_is_a_usage_error(capsys):
    assert profile_parse_main([]) == 2
    assert "usage: obd profile parse DIR [--json]" in capsys.readouterr().err
    assert profile_parse_main(["a", "b"]) == 2
    assert profile_parse_main(["--yaml", "a"]) == 2
    assert "unknown option '--yaml'" in capsys.readouterr().err


def test_profile_parse_of_a_missing_directory_exits_1_with_a_message(tmp_path, capsys):
    assert profile_parse_main([str(tmp_path / "gone")]) == 1
    assert "does not exist" in capsys.readouterr().err
    (tmp_path / "file").write_text("")
    assert profile_parse_main([str(tmp_path / "file")]) == 1
    assert "is not a directory" in capsys.readouterr().err


def test_profile_parse_prints_a_table_with_kernels_budget_and_sources(fixtures, capsys):
    assert profile_parse_main([str(fixtures / "run_o_name")]) == 0
    out = capsys.readouterr().out
    assert out.startswith("runner_kind: live")
    assert "Top kernels" in out and "Waste budget" in out
    assert "ncclDevKernel_Generic(ncclDevKernelArgsStorage<4096ul>)" in out
    assert "agent_info.csv: 304 CUs x 2100 MHz" in out


def test_python_dash_m_runner_cli_accepts_the_profile_parse_words_too(fixtures):
    done = subprocess.run(
        [sys.executable, "-m", "runner.cli", "profile", "parse", str(fixtures / "rocm62"), "--json"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert json.loads(done.stdout)["dispatch_count"] == 28


def test_unknown_numbers_print_as_unknown_never_as_zero():
    text = format_metrics(RunMetrics().model_dump(mode="json"))
    assert "tokens/s" in text and "unknown" in text
    assert " 0.0 " not in text


def test_format_accepts_an_empty_or_partial_dict_and_reports_an_invalid_one():
    assert format_metrics({}).startswith("runner_kind: live")
    assert format_metrics({"steps": 3, "warnings": ["x"]}).count("x") >= 1
    assert "metrics unreadable" in format_metrics({"steps": "many"})
