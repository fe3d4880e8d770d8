#!/bin/sh
# Installs every dependency (Debian packages, a Python venv for the end-to-end tests) and
# builds dflash into build/. Run as root on Debian 12 (or with sudo available).
set -eu
cd "$(dirname "$0")/.."
PKGS="build-essential cmake pkg-config gzip curl python3 python3-venv python3-pip valgrind
      libjansson-dev libmicrohttpd-dev libpcre2-dev libutf8proc-dev libssl-dev libcmocka-dev"
missing=""
for p in $PKGS; do dpkg -s "$p" >/dev/null 2>&1 || missing="$missing $p"; done
if [ -n "$missing" ]; then
  SUDO=""; [ "$(id -u)" = 0 ] || SUDO=sudo
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq $missing
fi
if [ ! -x .venv/bin/pytest ]; then
  python3 -m venv .venv
  .venv/bin/pip install -q -r tests/e2e/requirements.txt
fi
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build build -j "$(nproc)"
