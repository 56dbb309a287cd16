"""obd's sitecustomize in real interpreters: lazy under obd, inert outside, and it still runs the one it hides."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from tests.trainer_plugin.conftest import PY, RunDir

PROBE = (
    "import json, sys; print(json.dumps({"
    "'hook': any(getattr(f, '_obd_trainer_finder', False) for f in sys.meta_path), "
    "'heavy': sorted(m for m in ('torch', 'transformers') if m in sys.modules), "
    "'plugin_imported': 'trainer_plugin' in sys.modules, "
    "'sitecustomize': getattr(sys.modules.get('sitecustomize'), '__file__', None)}))"
)


def probe(env: dict[str, str], cwd: Path) -> dict:
    out = subprocess.run([PY, "-c", PROBE], env=env, cwd=cwd, capture_output=True, text=True, timeout=60, check=False)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def other_sitecustomize(root: Path, marker: Path) -> Path:
    """A sitecustomize of someone else's (a distro's, a venv's) that leaves a mark when it runs."""
    other = root / "other_site"
    other.mkdir()
    (other / "sitecustomize.py").write_text(f"open({str(marker)!r}, 'a').write(__name__ + '\\n')\n")
    return other


def test_under_obd_it_installs_the_trainer_hook_without_importing_torch_or_transformers(
    run_dir: RunDir, tmp_path: Path
) -> None:
    seen = probe(run_dir.env(), tmp_path)
    assert seen["sitecustomize"] == str(run_dir.plugin / "sitecustomize.py")
    assert seen["hook"] is True
    assert seen["heavy"] == []


def test_outside_obd_it_installs_nothing_and_imports_nothing(run_dir: RunDir, tmp_path: Path) -> None:
    seen = probe(run_dir.env(obd=False), tmp_path)
    assert seen["sitecustomize"] == str(run_dir.plugin / "sitecustomize.py")
    assert seen["hook"] is False and seen["plugin_imported"] is False and seen["heavy"] == []


def test_the_sitecustomize_it_hides_still_runs_under_obd_and_outside(run_dir: RunDir, tmp_path: Path) -> None:
    marker = tmp_path / "marker"
    other = other_sitecustomize(tmp_path, marker)
    for obd in (True, False):
        env = run_dir.env(obd=obd)
        env["PYTHONPATH"] += f":{other}"
        seen = probe(env, tmp_path)
        assert seen["hook"] is obd
    # It ran once per interpreter, under its own module name.
    assert marker.read_text() == "sitecustomize\nsitecustomize\n"


def test_an_error_in_the_hidden_sitecustomize_is_reported_and_the_job_still_starts(
    run_dir: RunDir, tmp_path: Path
) -> None:
    other = tmp_path / "broken_site"
    other.mkdir()
    (other / "sitecustomize.py").write_text("raise RuntimeError('broken distro hook')\n")
    env = run_dir.env()
    env["PYTHONPATH"] += f":{other}"
    out = subprocess.run(
        [PY, "-c", PROBE], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=60, check=False
    )
    assert out.returncode == 0
    assert json.loads(out.stdout)["hook"] is True
    assert "broken distro hook" in out.stderr


def test_two_plugin_directories_on_the_path_do_not_chain_in_a_loop(run_dir: RunDir, tmp_path: Path) -> None:
    second = RunDir(tmp_path / "second")
    marker = tmp_path / "marker"
    other = other_sitecustomize(tmp_path, marker)
    env = run_dir.env()
    env["PYTHONPATH"] = f"{run_dir.plugin}:{second.plugin}:{other}"
    seen = probe(env, tmp_path)
    assert seen["hook"] is True
    assert marker.read_text() == "sitecustomize\n"
