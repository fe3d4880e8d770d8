#!/bin/bash
# tools/gpu_run.sh: the GPU work's device run (issue 6; DEVICE.md). On the GPU machine, from a
# copy of this tree placed inside the checkout that travels (see tools/gpu_sync.sh):
#     cd .gpu-work && bash tools/gpu_run.sh [steps...]
# steps (default: info tests ops synth bench): info, tests (GPU exactness tests), ops
# (bench_cuda_ops), synth (27B-shaped pack into /tmp/p27, about 11 GB), bench (dflash bench on
# it), final (the same without block 16 and the memory runs), mem (peak memory at 1k and 32k),
# trace (the kernel timeline of a decode step and of verify passes: tools/trace_report.py),
# ab (plain decoding of VARIANTS alternating; a variant with BASE=1 runs the baseline binary),
# short (final's bench at block 4 only, 3 identity prompts), pdlgap (bench_pdl_gap), e2e (the
# end-to-end tests against the server build on the GPU), serve27 (tools/gpu_serve_check.py on
# the 27B-shaped pack), gen (`dflash generate` greedy and sampled, VARIANTS alternating). Library
# packages come from
# ../.gpu-deps (Debian .debs, unpacked into /tmp/pfx); binaries from prebuilt/ (built on the CPU
# machine with nvcc 13.0), else built here. Logs go to $OUT.
set -u
ROOT=$(cd .. && pwd)
OUT=${OUT:-/tmp/gpu-out}
mkdir -p "$OUT"
STEPS=${*:-"info tests ops synth bench"}
P=/tmp/pfx
mkdir -p $P
for f in ../.gpu-deps/*.deb; do dpkg -x "$f" $P; done
export LD_LIBRARY_PATH=$P/usr/lib/x86_64-linux-gnu
export DFLASH_FIXTURES=$ROOT/tests/fixtures DFLASH_SOURCE_DIR=$ROOT
[ -f prebuilt.tar.xz ] && [ ! -d prebuilt ] && tar -xJf prebuilt.tar.xz
BIN=$PWD/prebuilt
TB=$BIN
"$BIN/dflash-gpu" >/dev/null 2>&1
if [ $? -ne 2 ]; then
  echo "== prebuilt binaries do not run here; building" | tee -a "$OUT/summary.txt"
  export PKG_CONFIG_SYSROOT_DIR=$P PKG_CONFIG_LIBDIR=$P/usr/lib/x86_64-linux-gnu/pkgconfig
  (cmake -S . -B /tmp/b -DCMAKE_PREFIX_PATH=$P/usr -DDFLASH_SERVER=OFF -DCMAKE_CUDA_ARCHITECTURES=90 \
     -DCMAKE_BUILD_RPATH=$P/usr/lib/x86_64-linux-gnu -DCMAKE_BUILD_TYPE=RelWithDebInfo &&
   cmake --build /tmp/b -j16 --target dflash-gpu test_cuda_ops test_cuda_model bench_cuda_ops) > "$OUT/build.log" 2>&1
  tail -5 "$OUT/build.log"
  BIN=/tmp/b
  TB=/tmp/b/tests
fi
t() { /usr/bin/time -f "   (%e s)" "$@"; }
for s in $STEPS; do
  echo "== step $s $(date +%T)" | tee -a "$OUT/summary.txt"
  case $s in
  info)
    nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv 2>&1 | tee -a "$OUT/summary.txt" ;;
  tests)
    # TEST_ENV: settings the tests run under (e.g. a scheduling variant: the bits must not change)
    for tst in test_cuda_ops test_cuda_model; do
      env ${TEST_ENV:-X=1} timeout ${TEST_TIMEOUT:-200} "$TB/$tst" > "$OUT/$tst.log" 2>&1
      rc=$?
      echo "$tst ${TEST_ENV:-} rc=$rc" | tee -a "$OUT/summary.txt"
      grep -E "rel err|fixed point|fused|max \|delta\||greedy|speculative ==|FAILED|ERROR|Failure|differ|SKIP|PASSED|above|tolerance" "$OUT/$tst.log" | head -60 | tee -a "$OUT/summary.txt"
      if [ $rc -ne 0 ] && [ "$tst" = test_cuda_ops ] && [ "${SANITIZE:-1}" = 1 ]; then
        timeout 60 compute-sanitizer --tool memcheck --print-limit 20 "$TB/$tst" > "$OUT/sanitizer.log" 2>&1
        grep -E "ERROR SUMMARY|Invalid|at .* in " "$OUT/sanitizer.log" | head -20 | tee -a "$OUT/summary.txt"
      fi
    done ;;
  ops)
    timeout 240 "$BIN/bench_cuda_ops" --iters 30 2>&1 | tee "$OUT/bench_ops.log" | tee -a "$OUT/summary.txt" ;;
  synth)
    [ -f /tmp/p27/drafter/model.safetensors ] ||
      t timeout 400 "$BIN/dflash-gpu" synth --config 27b --out /tmp/p27 --tokenizer "$ROOT/models/demo" 2>&1 | tail -3 | tee -a "$OUT/summary.txt"
    du -sh /tmp/p27 /tmp/p27/drafter | tee -a "$OUT/summary.txt"
    mkdir -p /tmp/p27t # the pack without its drafter (trace, ab)
    for f in /tmp/p27/*; do [ "$(basename "$f")" = drafter ] || ln -sf "$f" /tmp/p27t/; done ;;
  bench)
    echo "cmd: dflash bench --model /tmp/p27 --ctx 1024 --gen 128 --block 16,8,4 --synthetic-acceptance 2.7 --synthetic-acceptance 4.5 --memory-ctx 1024,32768 --draft-quant-pass 8,4 --identity 5,200" >> "$OUT/summary.txt"
    t timeout 400 "$BIN/dflash-gpu" bench --model /tmp/p27 --ctx 1024 --gen 128 --block 16,8,4 \
      --synthetic-acceptance 2.7 --synthetic-acceptance 4.5 --memory-ctx 1024,32768 --draft-quant-pass 8,4 --identity 5,200 2>&1 | tee "$OUT/bench.log" | tee -a "$OUT/summary.txt" ;;
  final)
    echo "cmd: dflash bench --model /tmp/p27 --ctx 1024 --gen 128 --block 8,4 --synthetic-acceptance 2.7 --synthetic-acceptance 4.5 --draft-quant-pass 8,4 --identity 5,200" >> "$OUT/summary.txt"
    t timeout 420 "$BIN/dflash-gpu" bench --model /tmp/p27 --ctx 1024 --gen 128 --block 8,4 \
      --synthetic-acceptance 2.7 --synthetic-acceptance 4.5 --draft-quant-pass 8,4 --identity 5,200 2>&1 | tee "$OUT/bench.log" | tee -a "$OUT/summary.txt" ;;
  short)
    # SHORT_ARGS: more bench options (e.g. --draft-quant-pass 8,4)
    echo "cmd: dflash bench --model /tmp/p27 --ctx 1024 --gen 128 --block 4 --synthetic-acceptance 2.7 --synthetic-acceptance 4.5 --identity 3,200 ${SHORT_ARGS:-}" >> "$OUT/summary.txt"
    t timeout 300 "$BIN/dflash-gpu" bench --model /tmp/p27 --ctx 1024 --gen 128 --block 4 \
      --synthetic-acceptance 2.7 --synthetic-acceptance 4.5 --identity 3,200 ${SHORT_ARGS:-} 2>&1 | tee "$OUT/bench.log" | tee -a "$OUT/summary.txt" ;;
  exp)
    for v in "DFLASH_CUDA_KW=2" "DFLASH_CUDA_KW=4" "DFLASH_CUDA_TARGET_CTAS=264" "DFLASH_CUDA_TARGET_CTAS=132"; do
      echo "-- $v" | tee -a "$OUT/summary.txt"
      env $v timeout 120 "$BIN/bench_cuda_ops" --iters 20 2>&1 | grep -E "gdn in_proj_qkv|mlp gate|mlp down|lm_head|k_proj" | tee -a "$OUT/summary.txt"
    done
    echo "-- plain decode without graphs" | tee -a "$OUT/summary.txt"
    DFLASH_CUDA_GRAPHS=0 timeout 200 "$BIN/dflash-gpu" bench --model /tmp/p27 --ctx 1024 --gen 64 --no-verify-curve 2>&1 | grep -E "plain decode|floor|steps" | tee -a "$OUT/summary.txt" ;;
  occ)
    for v in DFLASH_CUDA_OCC=2 DFLASH_CUDA_OCC=3; do
      echo "-- $v" | tee -a "$OUT/summary.txt"
      env $v timeout 100 "$BIN/bench_cuda_ops" --iters 30 2>&1 | grep -E "M = 1|gdn in_proj_qkv|mlp gate|mlp down|k_proj|attn o_proj" | tee -a "$OUT/summary.txt"
      env ${v//,/ } timeout 150 "$BIN/dflash-gpu" bench --model /tmp/p27 --ctx 1024 --gen 64 --no-verify-curve 2>&1 | grep -E "plain decode|floor" | tee -a "$OUT/summary.txt"
    done ;;
  tests0)
    DFLASH_CUDA_PDL=0 timeout 300 "$TB/test_cuda_ops" > "$OUT/test_cuda_ops_pdl0.log" 2>&1
    echo "test_cuda_ops (DFLASH_CUDA_PDL=0) rc=$?" | tee -a "$OUT/summary.txt"
    grep -E "FAILED|ERROR|differ" "$OUT/test_cuda_ops_pdl0.log" | head -10 | tee -a "$OUT/summary.txt" ;;
  variants)
    for v in ${VARIANTS:-X=1 DFLASH_CUDA_PDL=0 DFLASH_CUDA_LINEAR=bf16split DFLASH_CUDA_TARGET_CTAS=528 DFLASH_CUDA_TARGET_CTAS=2112}; do
      echo "-- $v" | tee -a "$OUT/summary.txt"
      env ${v//,/ } timeout 150 "$BIN/dflash-gpu" bench --model /tmp/p27 --ctx 1024 --gen 64 --no-verify-curve 2>&1 | grep -E "plain decode|floor|graph|steps" | tee -a "$OUT/summary.txt"
    done ;;
  qvar)
    for v in ${QVARIANTS:-DFLASH_CUDA_QRING=0 DFLASH_CUDA_QRING=1}; do
      echo "-- $v" | tee -a "$OUT/summary.txt"
      env ${v//,/ } timeout 100 "$BIN/bench_cuda_ops" --quant-only --iters 30 2>&1 | grep -vE "^copy|^linear:" | tee -a "$OUT/summary.txt"
    done ;;
  ncuq)
    NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
    for v in ${QVARIANTS:-DFLASH_CUDA_QRING=0 DFLASH_CUDA_QRING=1}; do
      echo "-- ncu $v" | tee -a "$OUT/summary.txt"
      env ${v//,/ } timeout 200 "$NCU" --clock-control none --kernel-name regex:k_lin_q --launch-skip 2 --launch-count 1 \
        --section SpeedOfLight --section Occupancy --section WarpStateStats --section LaunchStats --section SchedulerStats --section InstructionStats \
        --metrics smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio,smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio,smsp__average_warps_issue_stalled_short_scoreboard_per_issue_active.ratio,smsp__average_warps_issue_stalled_wait_per_issue_active.ratio,smsp__average_warps_issue_stalled_math_pipe_throttle_per_issue_active.ratio,smsp__average_warps_issue_stalled_mio_throttle_per_issue_active.ratio,smsp__average_warps_issue_stalled_lg_throttle_per_issue_active.ratio,smsp__average_warps_issue_stalled_not_selected_per_issue_active.ratio,smsp__average_warps_issue_stalled_selected_per_issue_active.ratio,smsp__average_warps_issue_stalled_dispatch_stall_per_issue_active.ratio,smsp__average_warps_issue_stalled_no_instruction_per_issue_active.ratio,smsp__average_warps_issue_stalled_branch_resolving_per_issue_active.ratio,smsp__average_warps_issue_stalled_membar_per_issue_active.ratio,smsp__average_warps_issue_stalled_misc_per_issue_active.ratio,smsp__average_warps_issue_stalled_drain_per_issue_active.ratio,smsp__average_warps_issue_stalled_sleeping_per_issue_active.ratio,smsp__average_warps_issue_stalled_tex_throttle_per_issue_active.ratio \
        "$BIN/bench_cuda_ops" --quant-only --shape "${NCU_SHAPE:-mlp gate}" --iters 2 > "$OUT/ncuq.log" 2>&1
      grep -vE "^==PROF==|^    -----|^\s*$" "$OUT/ncuq.log" | grep -A200 "k_lin_q" | head -120 | tee -a "$OUT/summary.txt"
    done
    CO=$(command -v cuobjdump || ls /usr/local/cuda*/bin/cuobjdump 2>/dev/null | head -1)
    [ -n "$CO" ] && "$CO" -sass -fun '_Z8k_lin_qrILi2ELi128ELi1ELi3ELb1ELi0EEv7qlaunch' "$BIN/bench_cuda_ops" > "$OUT/sass_qr.txt" 2>&1
    [ -n "$CO" ] && "$CO" -sass -fun '_Z7k_lin_qILi2ELi128ELi1ELi1ELi2ELb1EEv7qlaunch' "$BIN/bench_cuda_ops" > "$OUT/sass_q.txt" 2>&1
    ls -la "$OUT" ;;
  block)
    for v in ${VARIANTS:-X=1}; do
      echo "-- $v" | tee -a "$OUT/summary.txt"
      env ${v//,/ } timeout 100 "$BIN/bench_cuda_ops" --block --iters 40 2>&1 | grep -v "^copy" | tee -a "$OUT/summary.txt"
    done ;;
  vcurve)
    for v in ${VARIANTS:-X=1}; do
      echo "-- $v" | tee -a "$OUT/summary.txt"
      exe="$BIN/dflash-gpu"; case "$v" in *BASE=1*) exe="$BIN/dflash-gpu-base" ;; esac
      env ${v//,/ } timeout 150 "$exe" bench --model /tmp/p27 --ctx 1024 --gen 96 --block 4 --synthetic-acceptance 2.7 --synthetic-acceptance 4.5 2>&1 | grep -E "plain decode|B= ?[0-9]|synthetic|per round" | tee -a "$OUT/summary.txt"
    done ;;
  trace)
    # the kernel timeline in place (DFLASH_CUDA_TRACE; tools/trace_report.py): the last plain
    # decode step, then verify passes of 1, 4, 8 and 16 rows; a pack view without the drafter
    mkdir -p /tmp/p27t
    for f in /tmp/p27/*; do [ "$(basename "$f")" = drafter ] || ln -sf "$f" /tmp/p27t/; done
    i=0
    for v in ${VARIANTS:-X=1}; do
      i=$((i + 1))
      echo "-- $v (untraced, then traced)" | tee -a "$OUT/summary.txt"
      env ${v//,/ } timeout 100 "$BIN/dflash-gpu" bench --model /tmp/p27t --ctx 1024 --gen 64 --no-verify-curve 2>&1 | grep -E "plain decode" | tee -a "$OUT/summary.txt"
      env ${v//,/ } DFLASH_CUDA_TRACE=/tmp/trace.bin timeout 150 "$BIN/dflash-gpu" bench --model /tmp/p27t --ctx 1024 --gen 16 --no-verify-curve 2>&1 | grep -E "plain decode" | tee -a "$OUT/summary.txt"
      timeout 120 python3 tools/trace_report.py /tmp/trace.bin --step=-3,-2 --list 700 > "$OUT/trace_${i}_plain.txt" 2>&1
      [ "$i" = 1 ] && python3 tools/trace_report.py /tmp/trace.bin --cut 400000 /tmp/trace_tail.bin && gzip -c /tmp/trace_tail.bin > "$OUT/trace_tail.bin.gz"
      grep -vE "^ +[0-9]+ +[0-9.]+ k_" "$OUT/trace_${i}_plain.txt" | tee -a "$OUT/summary.txt"
      env ${v//,/ } DFLASH_CUDA_TRACE=/tmp/trace.bin timeout 150 "$BIN/dflash-gpu" bench --model /tmp/p27t --ctx 1024 --gen 16 --repeats 1 2>&1 | grep -E "B= ?[0-9]" | tee -a "$OUT/summary.txt"
      timeout 120 python3 tools/trace_report.py /tmp/trace.bin --step=${TRACE_STEPS:--16,-13,-12,-9,-1} --list 1100 > "$OUT/trace_${i}_verify.txt" 2>&1
      grep -vE "^ +[0-9]+ +[0-9.]+ k_" "$OUT/trace_${i}_verify.txt" | tee -a "$OUT/summary.txt"
      rm -f /tmp/trace.bin
    done ;;
  ptrace)
    # plain decode steps traced with the baseline binary and this one: the by-kernel summary
    for exe in dflash-gpu-base dflash-gpu; do
      echo "-- $exe" | tee -a "$OUT/summary.txt"
      DFLASH_CUDA_TRACE=/tmp/trace.bin timeout 150 "$BIN/$exe" bench --model /tmp/p27t --ctx 1024 --gen 16 --no-verify-curve 2>&1 | grep -E "plain decode" | tee -a "$OUT/summary.txt"
      timeout 120 python3 tools/trace_report.py /tmp/trace.bin --step=-3 > "$OUT/ptrace_$exe.txt" 2>&1
      grep -vE "^ +[0-9]+ +[0-9.]+ k_" "$OUT/ptrace_$exe.txt" | tee -a "$OUT/summary.txt"
      rm -f /tmp/trace.bin
    done ;;
  spec)
    # speculative A/B: VARIANTS alternating AB_ROUNDS times (BASE=1: the baseline binary), block 4,
    # synthetic acceptance 2.7 and 4.5, no verify curve
    for r in $(seq 1 ${AB_ROUNDS:-2}); do
      for v in ${VARIANTS:-BASE=1 X=1}; do
        echo "-- $v round $r" | tee -a "$OUT/summary.txt"
        exe="$BIN/dflash-gpu"; case "$v" in *BASE=1*) exe="$BIN/dflash-gpu-base" ;; esac
        env ${v//,/ } timeout 150 "$exe" bench --model /tmp/p27 --ctx 1024 --gen 128 --block 4 --synthetic-acceptance 2.7 \
          --synthetic-acceptance 4.5 --no-verify-curve ${SPEC_ARGS:-} 2>&1 | grep -E "plain decode|synthetic|per round|drafter pass" | tee -a "$OUT/summary.txt"
      done
    done ;;
  attn)
    # attention alone (bench_cuda_ops --attention) under AVARIANTS, alternating AB_ROUNDS times
    for r in $(seq 1 ${AB_ROUNDS:-2}); do
      for v in ${AVARIANTS:-X=1 DFLASH_CUDA_ATTN_CHUNK=64}; do
        echo "-- $v round $r" | tee -a "$OUT/summary.txt"
        env ${v//,/ } timeout 100 "$BIN/bench_cuda_ops" --attention --iters 30 2>&1 | grep -E "attention|error" | tee -a "$OUT/summary.txt"
      done
    done ;;
  dtrace)
    # drafter passes of block DTRACE_BLOCK (default 8) traced, the baseline binary and this one:
    # the by-kernel summary of the last steps (a verify step, then a drafter step, alternating)
    for exe in dflash-gpu-base dflash-gpu; do
      echo "-- $exe" | tee -a "$OUT/summary.txt"
      DFLASH_CUDA_TRACE=/tmp/trace.bin timeout 150 "$BIN/$exe" bench --model /tmp/p27 --ctx 1024 --gen 24 --block ${DTRACE_BLOCK:-8} \
        --synthetic-acceptance 2.7 --no-verify-curve --repeats 1 2>&1 | grep -E "synthetic|per round" | tee -a "$OUT/summary.txt"
      timeout 120 python3 tools/trace_report.py /tmp/trace.bin --step=-3,-2 --list 120 > "$OUT/dtrace_$exe.txt" 2>&1
      grep -vE "^ +[0-9]+ +[0-9.]+ k_" "$OUT/dtrace_$exe.txt" | tee -a "$OUT/summary.txt"
      rm -f /tmp/trace.bin
    done ;;
  ncuattn)
    # ncu on the first attention launch of bench_cuda_ops --attention (1 row at context 1024)
    NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
    timeout 240 "$NCU" --clock-control none --kernel-name regex:${NCU_KERNELS:-k_attn_tile} --launch-skip ${NCU_SKIP:-0} --launch-count 1 \
      --section SpeedOfLight --section Occupancy --section WarpStateStats --section LaunchStats --section SchedulerStats --section MemoryWorkloadAnalysis \
      "$BIN/bench_cuda_ops" --attention --iters 2 > "$OUT/ncuattn.log" 2>&1
    grep -vE "^==PROF==|^    -----|^\s*$" "$OUT/ncuattn.log" | grep -A150 "${NCU_KERNELS:-k_attn_tile}" | head -150 | tee -a "$OUT/summary.txt" ;;
  spectrace)
    # the kernel timeline of speculative rounds (τ = 2.7, block 4): steps split at k_embed, so a
    # verify pass (with the settle and the drafter's context after it), then a drafter pass
    DFLASH_CUDA_TRACE=/tmp/trace.bin timeout 150 "$BIN/dflash-gpu" bench --model /tmp/p27 --ctx 1024 --gen 32 --block 4 \
      --synthetic-acceptance 2.7 --no-verify-curve --repeats 1 ${SPEC_ARGS:-} 2>&1 | grep -E "synthetic|per round|phase" | tee -a "$OUT/summary.txt"
    timeout 120 python3 tools/trace_report.py /tmp/trace.bin --step=${TRACE_STEPS:--5,-4,-3,-2} --list 900 > "$OUT/trace_spec.txt" 2>&1
    grep -vE "^ +[0-9]+ +[0-9.]+ k_" "$OUT/trace_spec.txt" | tee -a "$OUT/summary.txt"
    rm -f /tmp/trace.bin ;;
  ab)
    # plain decoding of the settings in VARIANTS, alternating, AB_ROUNDS times (same-run ratios)
    for r in $(seq 1 ${AB_ROUNDS:-3}); do
      for v in ${VARIANTS:-X=1}; do
        printf -- "-- %s round %s: " "$v" "$r" | tee -a "$OUT/summary.txt"
        # BASE=1: the baseline binary (prebuilt/dflash-gpu-base, from tools/gpu_sync.sh BASE_BUILD)
        exe="$BIN/dflash-gpu"; case "$v" in *BASE=1*) exe="$BIN/dflash-gpu-base" ;; esac
        env ${v//,/ } timeout 100 "$exe" bench --model /tmp/p27t --ctx 1024 --gen ${AB_GEN:-64} --no-verify-curve 2>&1 | grep -E "plain decode|host time|commands recorded|generate loop" | tee -a "$OUT/summary.txt"
      done
    done ;;
  gen)
    # the product's plain loop (`dflash generate`, no drafter) greedy and sampled, for VARIANTS
    # alternating AB_ROUNDS times (BASE=1: the baseline binary)
    for r in $(seq 1 ${AB_ROUNDS:-2}); do
      for v in ${VARIANTS:-X=1}; do
        exe="$BIN/dflash-gpu"; case "$v" in *BASE=1*) exe="$BIN/dflash-gpu-base" ;; esac
        for samp in "--temperature 0" "--temperature 1 --top-p 0.95 --top-k 0 --seed 1" "--temperature 0.7 --top-k 20 --top-p 1 --seed 1"; do
          printf -- "-- %s round %s, %s: " "$v" "$r" "$samp" | tee -a "$OUT/summary.txt"
          env ${v//,/ } timeout 100 "$exe" generate --device cuda --model /tmp/p27t --prompt "The history of the printing press begins" \
            --max-tokens ${AB_GEN:-128} $samp 2>&1 >/dev/null | grep -E "generated" | tee -a "$OUT/summary.txt"
        done
      done
    done ;;
  tune)
    for v in DFLASH_CUDA_TARGET_CTAS=264 DFLASH_CUDA_TARGET_CTAS=528 DFLASH_CUDA_OCC=3; do
      echo "-- $v" | tee -a "$OUT/summary.txt"
      env $v timeout 100 "$BIN/dflash-gpu" bench --model /tmp/p27 --ctx 1024 --gen 64 --no-verify-curve 2>&1 | grep -E "plain decode" | tee -a "$OUT/summary.txt"
    done ;;
  ncu)
    NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
    timeout 200 "$NCU" --clock-control none --launch-skip 3000 --launch-count 500 --metrics gpu__time_duration.sum,dram__bytes_read.sum \
      --print-summary per-kernel "$BIN/dflash-gpu" bench --model /tmp/p27 --ctx 16 --gen 4 --no-verify-curve > "$OUT/ncu.log" 2>&1
    grep -E "^  [a-zA-Z_].*\(|gpu__time_duration|dram__bytes_read" "$OUT/ncu.log" | head -120 | tee -a "$OUT/summary.txt" ;;
  ncud)
    NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
    timeout 300 "$NCU" --clock-control none --kernel-name regex:"${NCU_KERNELS:-k_lin_mma}" --launch-skip ${NCU_SKIP:-0} --launch-count ${NCU_COUNT:-80} \
      --metrics gpu__time_duration.sum,dram__bytes_read.sum --print-summary per-kernel \
      "$BIN/dflash-gpu" bench --model /tmp/p27 --ctx 64 --gen 8 --no-verify-curve --repeats 1 > "$OUT/ncud.log" 2>&1
    grep -E "^  [a-zA-Z_].*\(|gpu__time_duration|dram__bytes_read" "$OUT/ncud.log" | head -80 | tee -a "$OUT/summary.txt" ;;
  ncustep)
    # ncu on the decode step's small kernels (NCU_KERNELS, default GDN and the input preparation)
    # of dflash bench at context 16 (launches past the prefill: NCU_SKIP), then the source
    # counters of the first of them (CSV, for tools' offline reading)
    NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
    timeout 240 "$NCU" --clock-control none --kernel-name regex:"${NCU_KERNELS:-k_gdn_fused|k_qprep_fast}" --launch-skip ${NCU_SKIP:-600} --launch-count ${NCU_COUNT:-4} \
      --section SpeedOfLight --section Occupancy --section WarpStateStats --section LaunchStats --section SchedulerStats --section MemoryWorkloadAnalysis \
      "$BIN/dflash-gpu" bench --model /tmp/p27t --ctx 16 --gen 8 --no-verify-curve --repeats 1 > "$OUT/ncustep.log" 2>&1
    grep -vE "^==PROF==|^    -----|^\s*$" "$OUT/ncustep.log" | head -400 | tee -a "$OUT/summary.txt"
    timeout 240 "$NCU" --clock-control none --kernel-name regex:"${NCU_SRC:-k_gdn_fused}" --launch-skip ${NCU_SKIP:-600} --launch-count 1 \
      --section SourceCounters --section WarpStateStats --import-source no --page source --csv --print-source sass \
      "$BIN/dflash-gpu" bench --model /tmp/p27t --ctx 16 --gen 8 --no-verify-curve --repeats 1 > "$OUT/ncustep_src.csv" 2> "$OUT/ncustep_src.err"
    wc -l "$OUT/ncustep_src.csv" | tee -a "$OUT/summary.txt" ;;
  ncusrc)
    NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
    timeout 300 "$NCU" --clock-control none --kernel-name regex:${NCU_KERNELS:-k_lin_qb} --launch-skip 2 --launch-count 1 \
      --section SourceCounters --section WarpStateStats --import-source no --page source --csv --print-source sass \
      "$BIN/bench_cuda_ops" --quant-only --shape "${NCU_SHAPE:-mlp gate}" --iters 2 > "$OUT/ncusrc.csv" 2> "$OUT/ncusrc.err"
    wc -l "$OUT/ncusrc.csv" | tee -a "$OUT/summary.txt"; head -3 "$OUT/ncusrc.csv" | cut -c1-600 ;;
  ncudeep)
    NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
    timeout 240 "$NCU" --clock-control none --kernel-name regex:k_lin_q --launch-skip 40 --launch-count 3 \
      --section SpeedOfLight --section Occupancy --section WarpStateStats --section MemoryWorkloadAnalysis --section LaunchStats --section SchedulerStats \
      "$BIN/dflash-gpu" bench --model /tmp/p27 --ctx 16 --gen 4 --no-verify-curve > "$OUT/ncudeep.log" 2>&1
    grep -vE "^==PROF==|^    -----|^\s*$" "$OUT/ncudeep.log" | grep -A200 "k_lin_q" | head -150 | tee -a "$OUT/summary.txt" ;;
  pdlgap)
    # how soon a dependent kernel goes on after the one before it ends: PDL wait against a flag
    timeout 60 "$BIN/bench_pdl_gap" 2>&1 | tee -a "$OUT/summary.txt" ;;
  e2e)
    # the end-to-end tests (tests/e2e) with every server and `generate` of the tests on the GPU
    # (DFLASH_E2E_DEVICE=cuda): the server build (prebuilt/dflash-srv, gpu_sync.sh), the
    # demo model through prebuilt/../models, Python packages as wheels from ../.whl
    # (tools/gpu_wheels.sh makes them)
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
      "$ROOT"/.whl/*.whl > "$OUT/e2e.log" 2>&1
    [ -e models ] || ln -s "$ROOT/models" models
    (cd "$ROOT" && PYTHONPATH=/tmp/site DFLASH_BIN=$BIN/dflash-srv DFLASH_E2E_DEVICE=cuda \
       timeout ${E2E_TIMEOUT:-420} python3 -m pytest -q -p no:cacheprovider tests/e2e ${E2E_ARGS:-}) >> "$OUT/e2e.log" 2>&1
    echo "e2e rc=$?" | tee -a "$OUT/summary.txt"
    grep -E "passed|failed|^FAILED|^ERROR" "$OUT/e2e.log" | tail -40 | tee -a "$OUT/summary.txt" ;;
  serve27)
    # the server on the 27B-shaped pack: answers, token identity with plain generate, speed
    t timeout 500 python3 tools/gpu_serve_check.py --bin "$BIN/dflash-srv" --model /tmp/p27 \
      --drafter /tmp/p27/drafter ${SERVE_ARGS:-} 2>&1 | tee "$OUT/serve27.log" | tee -a "$OUT/summary.txt"
    cp /tmp/gpu-serve.log "$OUT/" 2>/dev/null ;;
  mem)
    echo "cmd: dflash bench --model /tmp/p27 --ctx 1024 --gen 32 --no-verify-curve --memory-ctx 1024,32768" >> "$OUT/summary.txt"
    t timeout 400 "$BIN/dflash-gpu" bench --model /tmp/p27 --ctx 1024 --gen 32 --no-verify-curve \
      --memory-ctx 1024,32768 2>&1 | tee "$OUT/mem.log" | tee -a "$OUT/summary.txt" ;;
  esac
done
echo "== done $(date +%T)" | tee -a "$OUT/summary.txt"
