#!/bin/sh
# tools/gpu_wheels.sh: the Python packages of the end-to-end tests as wheels for the GPU machine,
# which reaches no package index (its python3 is CPython 3.12), into .whl/ (ignored by git;
# carried by the device runs of tools/gpu_run.sh's e2e step). The versions are those that
# tools/setup.sh installed into .venv.
set -eu
cd "$(dirname "$0")/.."
req=$(mktemp)
.venv/bin/pip freeze | grep -v '^-e ' > "$req"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl -r "$req"
rm -f "$req"
ls .whl | wc -l
