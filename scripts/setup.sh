#!/usr/bin/env bash
# Sets up everything obd's demo and tests need, from a fresh clone: a virtual environment in
# .venv with obd and its dependencies (torch pinned by constraints.txt to the CPU build), and,
# when run as root, Debian's openssh-server for the sshd tests.
set -euo pipefail
cd "$(dirname "$0")/.."

if [ ! -x /usr/sbin/sshd ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "setup: installing openssh-server (for the SSH executor tests)"
    apt-get update -qq >/dev/null
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq openssh-server >/dev/null
fi

if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    bash scripts/setup_slurm.sh      # a real Slurm for the Slurm target's tests
    bash scripts/setup_browser.sh    # a headless browser for the web view's tests
fi

PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    "$PY" -m venv .venv
fi
stamp=.venv/.obd-installed
want=$(cat pyproject.toml constraints.txt | sha256sum | cut -c1-16)
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
    echo "setup: installing obd and its dependencies into .venv"
    .venv/bin/python -m pip install -q --upgrade pip 2>&1 | grep -v WARNING || true
    .venv/bin/python -m pip install -q -c constraints.txt -e '.[train,test]' 2>&1 | grep -Ev "WARNING|^\s*$" || true
    # (torch's compile cache made by the imports goes in a directory of its own, removed after)
    cache=$(mktemp -d)
    TORCHINDUCTOR_CACHE_DIR="$cache" .venv/bin/python -c "import torch, transformers, peft, asyncssh, runpod, anyio, pydantic, structlog"
    rm -rf "$cache"
    echo "$want" > "$stamp"
fi
