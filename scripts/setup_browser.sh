#!/usr/bin/env bash
# Installs what the web view's browser tests need (as root, on Debian): filled in with the web view.
set -euo pipefail
