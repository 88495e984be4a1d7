#!/usr/bin/env bash
# JupyterLab in a real browser: installs Debian's chromium and the playwright package (which drives that
# Chromium; never `playwright install`), then opens the course notebooks in headless Chromium, runs all
# cells and checks for errors and rendered widgets (tests/browser/test_jupyterlab.py).
# Usage: bash scripts/browser_test.sh [extra pytest args]   (PYTHON=... picks the interpreter; default python)
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python}"
if ! command -v "${NVE_CHROMIUM:-/usr/bin/chromium}" >/dev/null 2>&1; then
  SUDO=""
  if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
  $SUDO apt-get update -q
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q --no-install-recommends chromium
fi
"$PY" -m pip install -q playwright
# NVE_BROWSER_REQUIRED=1: a missing chromium/playwright fails the run instead of skipping it.
NVE_BROWSER_REQUIRED=1 OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" \
  "$PY" -m pytest -o addopts="" -p no:cacheprovider -ra -m browser tests/browser -v "$@"
