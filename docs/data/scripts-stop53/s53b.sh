#!/usr/bin/env bash
# stop 53 call 2: the tensor-core products with the MMA's accumulator input as the float bias (no integer add per
# sum), the shared-memory offsets of the token words as constants, the expert kernels skipping the column tiles of
# tiles with fewer than 8 groups, and the wide dense products (128 rows per block, STRATA_GPU_MMQ_WIDE=1) (issue 18). One binary (this stop's build), HEAD's kernels (STRATA_KERNEL_SOURCE=
# .dev/strata-old.cu) against the new ones (embedded; both prebuilt in .dev/kc-*): gpu-check of the new kernels, narrow
# and wide (rows against stop 51's, which HEAD's kernels give), bench-gpu --prompt 4096 / 512 --gen 32 on the Q4_0
# qwen3moe file (Qwen3-30B-A3B geometry, every expert in VRAM) alternating old, new and wide, per-call GPU times of
# each at 4,096, Nsight Compute sections of the main prefill kernels (new), memcheck of the mmq kernels. (Run with
# 6b15c3b's build, where the wide kernels were opt-in; from 011aad1 on they are the default on compute capability 9.0,
# so a rerun's "new" arm needs STRATA_GPU_MMQ_WIDE=0 to stay narrow.)
set -u
O=${OUT:?}; mkdir -p "$O"; L="$O/log.txt"
. tools/device-env.sh
unxz_to .dev/strata-tools-new.xz /tmp/cur
NEW="STRATA_NEW=1"; OLD="STRATA_KERNEL_SOURCE=$PWD/.dev/strata-old.cu"; WIDE="STRATA_GPU_MMQ_WIDE=1"
( /tmp/cur synth-moe --preset qwen3-30b-a3b --type q4_0 --skew 1.0 --arch native --out /tmp/q40.gguf 2>&1 | tail -1 >> "$L" ) &
SYN=$!
env "$NEW" timeout 200 /tmp/cur gpu-check --json "$O/check-new.json" > "$O/check-new.txt" 2>/tmp/check-new.log; echo "gpu-check new rc=$? $(date +%T)" >> "$L"
grep -m2 -i "kernel source\|compiled" /tmp/check-new.log >> "$L"
norm() { grep -E '^(Q|IQ|F|BF|MXFP|mmq|stack|split|expert|tiled|attn)' "$1" | grep -vE 'ms|tok/s' ; }
norm docs/data/stop51-call3-h100-check-fin.txt > /tmp/k1.txt; norm "$O/check-new.txt" > /tmp/k3.txt
echo "kernel rows: $(wc -l < /tmp/k1.txt) in stop 51, $(wc -l < /tmp/k3.txt) now; differing: $(diff /tmp/k1.txt /tmp/k3.txt | grep -c '^[<>]')" >> "$L"
diff /tmp/k1.txt /tmp/k3.txt > "$O/check-diff.txt"
grep -iE "worst|fail|panick" "$O/check-new.txt" /tmp/check-new.log | head -5 >> "$L"
wait $SYN; date >> "$L"
bench() {  # old|new file prompt gen tag [env]
  local v=$1 f=$2 n=$3 g=$4 tag=$5; shift 5
  local e="$NEW"; [ $v = old ] && e="$OLD"; [ $v = wide ] && e="$WIDE"
  env "$e" "$@" timeout 100 /tmp/cur bench-gpu --model $f --prompt $n --gen $g --fracs 1 --modes off --pcie 0 --batch 512 \
    --json "/tmp/b-$tag.json" > /tmp/b-$tag.txt 2>/tmp/b-$tag.log; local rc=$?
  echo "$tag rc=$rc: $(grep -E '^cache|decode after' /tmp/b-$tag.txt | tr -s ' ' | tr '\n' '|' | cut -c1-400)" >> "$L"
  grep -E "panicked|ERROR|error:" /tmp/b-$tag.log | head -2 >> "$L"
}
for r in 1 2; do
  for v in old new wide; do bench $v /tmp/q40.gguf 4096 32 q40-4096-$v-$r; done
  for v in old new wide; do bench $v /tmp/q40.gguf 512 32 q40-512-$v-$r; done
  [ $r = 1 ] || continue
  env "$WIDE" timeout 200 /tmp/cur gpu-check --json "$O/check-wide.json" > "$O/check-wide.txt" 2>/tmp/check-wide.log; echo "gpu-check wide rc=$? $(date +%T)" >> "$L"
  norm "$O/check-wide.txt" > /tmp/k4.txt
  echo "wide kernel rows: $(wc -l < /tmp/k4.txt); differing from stop 51: $(diff /tmp/k1.txt /tmp/k4.txt | grep -c '^[<>]')" >> "$L"
  grep -iE "worst|fail|panick" "$O/check-wide.txt" /tmp/check-wide.log | head -5 >> "$L"
done
for v in old new wide; do bench $v /tmp/q40.gguf 4096 4 q40-ops-$v STRATA_GPU_TIMING=ops; grep -h "GPU time by call" /tmp/b-q40-ops-$v.log | cut -c1-600 > "$O/ops-$v.txt"; done
cat /tmp/b-*.txt > "$O/bench.txt"
date >> "$L"
left=$((560 - SECONDS)); echo "sections with ${left}s left" >> "$L"
[ $left -gt 100 ] && { env "$NEW" timeout $((left - 60)) ncu --clock-control none --kernel-name "regex:^(mmq_q4_0|expert_gate_up_mmq_q4_0|expert_down_mmq_q4_0|rms_norm|attention_tiled|route_topk|group_by_expert)" \
  --launch-skip 450 --launch-count 9 \
  --section SpeedOfLight --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis --section Occupancy \
  --section LaunchStats --section SchedulerStats --section WarpStateStats --section InstructionStats \
  /tmp/cur bench-gpu --model /tmp/q40.gguf --prompt 1024 --gen 1 --fracs 1 --modes off --pcie 0 --batch 512 \
  > /tmp/sec.txt 2>&1; echo "sections rc=$? $(date +%T)" >> "$L"
  grep -v "^==PROF==" /tmp/sec.txt | grep -v "^ *$" | grep -v "^ *----" > "$O/sections.txt"; }
left=$((560 - SECONDS)); echo "sanitizer with ${left}s left" >> "$L"
[ $left -gt 40 ] && { env "$NEW" timeout $left compute-sanitizer --tool memcheck --print-limit 10 --kernel-name kns=mmq \
  /tmp/cur gpu-check > /tmp/san.txt 2>&1; echo "memcheck mmq kernels rc=$? $(date +%T)" >> "$L"
  grep -E "ERROR SUMMARY|Invalid" /tmp/san.txt | head -5 >> "$L"; }
left=$((575 - SECONDS)); echo "wide sanitizer with ${left}s left" >> "$L"
[ $left -gt 40 ] && { env "$WIDE" timeout $left compute-sanitizer --tool memcheck --print-limit 10 --kernel-name regex:mmq_.*_w \
  /tmp/cur gpu-check > /tmp/sanw.txt 2>&1; echo "memcheck wide mmq kernels rc=$? $(date +%T)" >> "$L"
  grep -E "ERROR SUMMARY|Invalid" /tmp/sanw.txt | head -5 >> "$L"; }
date >> "$L"
