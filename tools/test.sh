#!/bin/sh
# Builds and runs the whole test suite: the release build (unit, oracle, exactness and
# end-to-end tests), then the unit tests and the server's robustness suite (e2e_robustness:
# the sanitized server under malformed and hostile requests) again under ASan + UBSan.
set -eu
cd "$(dirname "$0")/.."
J="$(nproc)"
status=0
(cd build && ctest --output-on-failure -j "$J") || status=1
# (no CUDA backend in the sanitizer build: its code runs only on a GPU, and the release build
# above already compiles it with -Werror)
cmake -S . -B build-asan -DCMAKE_BUILD_TYPE=RelWithDebInfo -DDFLASH_SANITIZE=ON -DDFLASH_SERVER=ON -DDFLASH_CUDA=OFF >/dev/null
cmake --build build-asan -j "$J"
(cd build-asan && ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1 DFLASH_TEST_QUICK=1 \
   ctest --output-on-failure -j "$J" -E '^e2e$') || status=1
exit $status
