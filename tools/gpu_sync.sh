#!/bin/bash
# tools/gpu_sync.sh: prepares a device run (run on the CPU machine, from this worktree).
# Copies this worktree's files (tracked + untracked, not ignored) and stripped prebuilt GPU
# binaries from build-cuda/ into <checkout>/.gpu-work, the folder the device tool carries
# (it must be ignored there: /.gpu-work/ in .git/info/exclude). Usage: tools/gpu_sync.sh /work/main
set -eu
DEST=${1:?checkout}/.gpu-work
rm -rf "$DEST"
mkdir -p "$DEST/prebuilt"
git ls-files -co --exclude-standard | grep -v '^tests/fixtures/\|^models/' | tar -cf - -T - | tar -xf - -C "$DEST"
for b in dflash-gpu bench_cuda_ops bench_pdl_gap tests/test_cuda_ops tests/test_cuda_model; do
  strip -o "$DEST/prebuilt/$(basename $b)" "build-cuda/$b"
done
# the server build (build/: tools/setup.sh's, with the CUDA backend when nvcc is here) travels as
# dflash-srv, for the end-to-end tests on the GPU (gpu_run.sh's e2e step)
if [ -x build/dflash ]; then strip -o "$DEST/prebuilt/dflash-srv" build/dflash; fi
# BASE_BUILD=DIR: that build's dflash-gpu travels too, as the baseline of A/B runs (BASE=1)
if [ -n "${BASE_BUILD:-}" ]; then strip -o "$DEST/prebuilt/dflash-gpu-base" "$BASE_BUILD/dflash-gpu"; fi
# the four binaries share most of their GPU code: compressed together they travel in far less
tar -C "$DEST" -cJf "$DEST/prebuilt.tar.xz" prebuilt && rm -rf "$DEST/prebuilt"
du -sh "$DEST"
