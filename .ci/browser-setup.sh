#!/usr/bin/env bash
# What the browser test (tests/browser, `pytest -m browser`) needs besides the lab extra:
# Debian's Chromium and a font from the system package manager, and the Python `playwright`
# package that drives it. Nothing is downloaded at test time: never `playwright install`.
# Safe to run again: it installs only what is missing.
set -euo pipefail

if [ ! -x /usr/bin/chromium ]; then
    sudo=""
    if [ "$(id -u)" != "0" ]; then
        command -v sudo >/dev/null || { echo "browser-setup: need root or sudo for apt-get" >&2; exit 1; }
        sudo="sudo"
    fi
    command -v apt-get >/dev/null || {
        echo "browser-setup: no apt-get; install Chromium yourself and set FSDP_LAB_CHROMIUM=/path/to/chromium" >&2
        exit 1
    }
    $sudo apt-get update -q
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -q --no-install-recommends \
        chromium fonts-dejavu-core
fi
/usr/bin/chromium --version

python -c "import playwright" 2>/dev/null || python -m pip install --quiet "playwright>=1.45"
python -c "from importlib.metadata import version; print('playwright', version('playwright'))"
