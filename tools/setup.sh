#!/usr/bin/env bash
# Installs what dsa needs on a fresh Debian 12 machine: apt packages, then a
# .venv with the pinned Python packages. Idempotent and quick when done.
set -euo pipefail
cd "$(dirname "$0")/.."

# clang-14 and libclang-rt-14-dev: the libFuzzer build of tests/fuzz (make fuzz).
# ccache: the build and `pip install .` compile the same library objects (CMakeLists.txt).
apt_packages=(cmake ninja-build g++ libgtest-dev libbenchmark-dev python3-venv clang-14 libclang-rt-14-dev ccache)
missing=()
for p in "${apt_packages[@]}"; do
  dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "setup: installing apt packages: ${missing[*]}"
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO=sudo
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}" >/dev/null
fi

stamp=.venv/.requirements.sha
want=$(sha256sum requirements.txt | cut -d' ' -f1)
if [ ! -x .venv/bin/python ] || [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "setup: creating .venv with pinned packages (requirements.txt)"
  python3 -m venv .venv
  .venv/bin/python -m pip install -q --upgrade pip >/dev/null
  .venv/bin/python -m pip install -q -r requirements.txt
  echo "$want" > "$stamp"
fi

# The console scripts `pip install .` installs (pyproject.toml), for this checkout, whose
# package the Makefile puts on PYTHONPATH: dsa-train, dsa-bench and dsa-generate run from
# .venv/bin as the docs write them. Rewritten every time (cheap): the checkout may move.
root=$(pwd)
for entry in "dsa-train dsa.train" "dsa-bench dsa.bench" "dsa-generate dsa.generate"; do
  set -- $entry
  printf '#!/bin/sh\nPYTHONPATH="%s/python${PYTHONPATH:+:$PYTHONPATH}" exec "%s/.venv/bin/python" -m %s "$@"\n' \
    "$root" "$root" "$2" > ".venv/bin/$1"
  chmod +x ".venv/bin/$1"
done
