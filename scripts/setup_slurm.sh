#!/usr/bin/env bash
# Installs what the Slurm target's tests need (as root, on Debian): the controller, the node
# daemon, the client commands and munge. The tests start their own cluster under a temporary
# directory (tests/executors/slurm/cluster.py); nothing here is started or enabled.
set -euo pipefail
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
    echo "setup_slurm: not root on Debian; the Slurm tests will be skipped" >&2
    exit 0
fi
if command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v sbatch >/dev/null \
    && command -v munged >/dev/null; then
    exit 0
fi
echo "setup: installing slurmctld, slurmd, slurm-client and munge (for the Slurm target tests)"
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq >/dev/null
# policy-rc.d keeps the packages' own services from starting: the tests run their own daemons.
policy=/usr/sbin/policy-rc.d
made_policy=0
if [ ! -e "$policy" ]; then
    printf '#!/bin/sh\nexit 101\n' > "$policy"
    chmod 0755 "$policy"
    made_policy=1
fi
apt-get install -y -qq --no-install-recommends slurmctld slurmd slurm-client munge >/dev/null
if [ "$made_policy" = 1 ]; then
    rm -f "$policy"
fi
