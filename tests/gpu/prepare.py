"""The setup half of scripts/gpu_check.sh: obd's own dependencies beside the machine's torch, and the device probe.

    python tests/gpu/prepare.py deps --site DIR [--wheels DIR]    # make pydantic, anyio, structlog importable
    python tests/gpu/prepare.py probe [--json FILE]                # what torch and the vendors' tools see
    python tests/gpu/prepare.py fetch-wheels [--dest DIR] [--python-version 3.12]

Standard library only: it runs on a bare GPU machine before anything is installed. The GPU
machine's Python already holds torch, transformers, peft and pytest (the training environment is
never touched); obd's daemon needs pydantic, anyio and structlog on top (asyncssh only for SSH
targets, which the check does not use). `deps` finds them importable, or installs them into
`--site` (to be put on PYTHONPATH, ahead of nothing else the jobs need): from the wheels in
`--wheels` with no network (`fetch-wheels` downloads them, on a machine that has one, for the GPU
machine's Python), else from the package index if one answers. Nothing is installed into the
machine's own environments.

Exit status: 0 done (for `probe`: a CUDA/ROCm device is there); 3 setup failed (the message says
what to do); 77 (`probe` only) no device.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
WHEELS = Path(__file__).resolve().parent / "wheels"
# What obd's daemon imports beyond the standard library to serve a local target, with its floor (pyproject.toml).
NEEDED = {"pydantic": "2.6", "anyio": "4.3", "structlog": "24.1"}
SETUP_FAILED = 3
NO_DEVICE = 77
# The platforms a wheel for the GPU machine may be built for (x86-64 Linux, glibc 2.17 and up).
PLATFORMS = [f"manylinux_2_{n}_x86_64" for n in (39, 35, 34, 31, 28, 27, 24, 17)] + ["manylinux2014_x86_64"]


def _version_tuple(text: str) -> tuple[int, ...]:
    parts = []
    for piece in text.split("."):
        match = re.match(r"\d+", piece)
        if not match:
            break
        parts.append(int(match.group()))
    return tuple(parts)


def missing_deps(python: str, site: Path | None) -> dict[str, str]:
    """name -> what is wrong, for each of NEEDED that `python` (with `site` on its path) lacks or has too old."""
    code = (
        "import importlib.metadata as m, json, sys\n"
        "out = {}\n"
        f"for name in {sorted(NEEDED)!r}:\n"
        "    try:\n"
        "        __import__(name)\n"
        "        out[name] = m.version(name)\n"
        "    except Exception as exc:\n"
        "        out[name] = None\n"
        "print(json.dumps(out))\n"
    )
    env = dict(os.environ)
    if site is not None:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(site), env.get("PYTHONPATH", "")) if p)
    done = subprocess.run([python, "-c", code], capture_output=True, text=True, env=env, timeout=120, check=False)
    try:
        found = json.loads(done.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return dict.fromkeys(NEEDED, f"could not ask {python}: {done.stderr.strip()[-200:]}")
    wrong = {}
    for name, floor in NEEDED.items():
        version = found.get(name)
        if version is None:
            wrong[name] = "not importable"
        elif _version_tuple(version) < _version_tuple(floor):
            wrong[name] = f"{version} is older than {floor}"
    return wrong


def pip_install(python: str, site: Path, wheels: Path | None) -> tuple[bool, str]:
    """Install NEEDED (and what they need) into `site`: from `wheels` offline, else from the index."""
    site.mkdir(parents=True, exist_ok=True)
    argv = [python, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", "--target", str(site)]
    argv += ["--upgrade", "--no-warn-script-location"]
    if wheels is not None:
        argv += ["--no-index", "--find-links", str(wheels)]
    else:
        argv += ["--timeout", "15", "--retries", "0"]
    argv += [f"{name}>={floor}" for name, floor in sorted(NEEDED.items())]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=600, check=False)
    return done.returncode == 0, (done.stdout + done.stderr).strip()[-2000:]


def deps(python: str, site: Path, wheels: Path) -> int:
    wrong = missing_deps(python, None)
    if not wrong:
        print(f"setup: obd's dependencies ({', '.join(sorted(NEEDED))}) are importable by {python}")
        return 0
    print(f"setup: {python} lacks obd's dependencies: " + "; ".join(f"{k} {v}" for k, v in sorted(wrong.items())))
    if not missing_deps(python, site):
        print(f"setup: found them installed in {site} (an earlier run)")
        return 0
    have_wheels = wheels.is_dir() and any(wheels.glob("*.whl"))
    ok, output = pip_install(python, site, wheels if have_wheels else None)
    where = f"the wheels in {wheels}" if have_wheels else "the package index"
    if ok and not missing_deps(python, site):
        print(f"setup: installed them into {site} from {where}")
        return 0
    print(f"setup FAILED: could not install them from {where}:\n{output}", file=sys.stderr)
    print(
        "setup: on a machine with a package index, run `bash scripts/gpu_check.sh --fetch-wheels` in this "
        f"repository (it fills {WHEELS.relative_to(REPO)}/ for the GPU machine's Python), and bring that folder "
        "along (the device tool: carry it)",
        file=sys.stderr,
    )
    return SETUP_FAILED


def probe(json_out: Path | None) -> int:
    sys.path.insert(0, str(REPO))
    from tests.gpu import harness

    found = harness.probe()
    print(f"probe: {found.describe()}")
    for tool, text in (("nvidia-smi -L", found.nvidia_smi), ("amd-smi list", found.amd_smi)):
        first = (text or "").strip().splitlines()
        print(
            f"probe: {tool}: {first[0] if first else 'not found or no GPU'}"
            + (f" (+{len(first) - 1} more)" if len(first) > 1 else "")
        )
    if json_out is not None:
        json_out.write_text(
            json.dumps({"torch": found.torch, "nvidia_smi": found.nvidia_smi, "amd_smi": found.amd_smi})
        )
    reason = found.no_device_reason()
    if reason:
        print(f"probe: {reason}")
        return NO_DEVICE
    return 0


def fetch_wheels(dest: Path, python_version: str) -> int:
    """Download NEEDED and their dependencies as wheels for CPython `python_version` on x86-64 Linux, at this environment's versions."""
    dest.mkdir(parents=True, exist_ok=True)
    pins = []
    for name, floor in sorted(NEEDED.items()):
        try:
            pins.append(f"{name}=={importlib.metadata.version(name)}")  # the versions this repository is tested with
        except importlib.metadata.PackageNotFoundError:
            pins.append(f"{name}>={floor}")
    argv = [sys.executable, "-m", "pip", "download", "--only-binary=:all:", "--dest", str(dest)]
    argv += ["--python-version", python_version, "--implementation", "cp"]
    for platform in PLATFORMS:
        argv += ["--platform", platform]
    done = subprocess.run([*argv, *pins], capture_output=True, text=True, timeout=900, check=False)
    print((done.stdout + done.stderr).strip()[-3000:])
    if done.returncode != 0:
        print(f"fetch-wheels FAILED (pip exit {done.returncode})", file=sys.stderr)
        return SETUP_FAILED
    wheels = sorted(p.name for p in dest.glob("*.whl"))
    size = sum(p.stat().st_size for p in dest.glob("*.whl"))
    print(
        f"fetch-wheels: {len(wheels)} wheels for CPython {python_version} in {dest} ({size / 2**20:.1f} MiB): {', '.join(wheels)}"
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    d = sub.add_parser("deps", help="make obd's dependencies importable")
    d.add_argument("--python", default=sys.executable, help="the Python that will run obd and the tests")
    d.add_argument("--site", type=Path, required=True)
    d.add_argument("--wheels", type=Path, default=WHEELS)
    pr = sub.add_parser("probe", help="what devices torch and the vendors' tools see")
    pr.add_argument("--json", type=Path)
    f = sub.add_parser("fetch-wheels", help="download the wheels for the GPU machine (needs a package index)")
    f.add_argument("--dest", type=Path, default=WHEELS)
    f.add_argument("--python-version", default="3.12", help="the GPU machine's Python (3.12 on the H200 machine)")
    opts = p.parse_args(argv)
    if opts.command == "deps":
        return deps(opts.python, opts.site, opts.wheels)
    if opts.command == "probe":
        return probe(opts.json)
    return fetch_wheels(opts.dest, opts.python_version)


if __name__ == "__main__":
    sys.exit(main())
