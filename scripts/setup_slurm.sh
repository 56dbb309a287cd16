#!/usr/bin/env bash
# Installs what the Slurm target's tests need (as root, on Debian): filled in with the Slurm target.
set -euo pipefail
