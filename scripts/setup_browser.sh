#!/usr/bin/env bash
# Installs what the web view's browser tests need (as root, on Debian): Debian's chromium and
# its chromedriver. The tests (tests/daemon/test_ui.py) start a headless chromium of their own
# with a fresh profile and skip, saying why, when it is absent. Nothing is started here.
set -euo pipefail
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
    echo "setup_browser: not root on Debian; the web view's browser tests will be skipped" >&2
    exit 0
fi
if command -v chromium >/dev/null && command -v chromedriver >/dev/null; then
    exit 0
fi
echo "setup: installing chromium and chromium-driver (for the web view's browser tests)"
export DEBIAN_FRONTEND=noninteractive
# Another setup script may hold apt's lock for a while: wait for it rather than fail.
apt-get -o DPkg::Lock::Timeout=600 update -qq >/dev/null
apt-get -o DPkg::Lock::Timeout=600 install -y -qq --no-install-recommends chromium chromium-driver fonts-dejavu-core >/dev/null
