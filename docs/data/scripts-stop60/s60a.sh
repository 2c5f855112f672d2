#!/usr/bin/env bash
# stop 60 (issues 18, 19): the current build (.dev/strata-tools.xz, .dev/kc-*.tar.xz for the current .cu) against
# llama.cpp built on the same host, in calls short enough to come back when a lease is cut short; each PART reuses
# what an earlier PART left in /tmp on a warm machine and rebuilds it otherwise.
# PART=A: llama.cpp built at nice 19 meanwhile the Q4_K_M and IQ2_XS files' strata arms with every expert in VRAM run
#   (GPU-bound; they ran beside a 16-job build: say so with their figures); then llama-bench on those two files.
# PART=B: nothing else running: issue 18's table on the Q4_0 file (llama-bench -fa 1, all in VRAM and -ncmoe 24;
#   strata bench-gpu prefill 512 / 4,096 and decode after them, all in VRAM and half off, static and blocking).
# PART=C: Q4_K_M and IQ2_XS half off VRAM, both engines (-ncmoe 24; cache 50%, static and blocking).
# PART=D (a later build: bench-gpu's warm-up decodes two tokens): llama.cpp built meanwhile the GPU-bound work runs:
#   per-call GPU times of a 512-token chunk (STRATA_GPU_TIMING=ops) on IQ2_XS, decode after 4,096 tokens
#   with every expert in VRAM (32 tokens); then, nothing else running, llama-bench decode after 4,096 (all in
#   VRAM and -ncmoe 24) and strata half off VRAM after 4,096 tokens, static, PCIe shares 0, 0.33 and auto.
# PART=E: PART=D without llama.cpp (too little device time left for its build; ratios then across hosts).
set -u
O=${OUT:?}; mkdir -p "$O"; L="$O/log.txt"
. tools/device-env.sh
[ -x /tmp/cur ] || unxz_to .dev/strata-tools.xz /tmp/cur
synth() { synth_native /tmp/cur "$@"; }
run() { bench_gpu_arm /tmp/cur "$@"; }
LB=/tmp/lc/llama.cpp/build/bin/llama-bench
lb() {  # each run's rows in a file of its own, its own return code
  local t=$1 m=$2; shift 2; timeout $t $LB -m $m -t 16 -ngl 99 "$@" -o md > /tmp/lb1.md 2>/tmp/lb.log; local rc=$?
  grep "^|" /tmp/lb1.md >> "$O/lb.md"; echo "llama-bench $(basename $m) $* rc=$rc at ${SECONDS}s: $(grep '^|' /tmp/lb1.md | tail -2 | tr -s ' ' | tr '\n' ' ')" >> "$L"; }
ensure_llama() { [ -x $LB ] || build_llama_bench; }
Q=/tmp/q40.gguf; K=/tmp/q4km.gguf; I=/tmp/iq2xs.gguf
case "${PART:-A}" in
A)
  ensure_llama & LBP=$!
  synth q4_k_m $K; synth iq2_xs $I
  run q4km $K 512 1 off 32
  run iq2xs $I 512 1 off 32
  synth q4_0 $Q
  wait $LBP
  lb 60 $K -p 512 -n 32 -fa 1
  lb 60 $I -p 512 -n 32 -fa 1
  ;;
B)
  ensure_llama; synth q4_0 $Q
  lb 60 $Q -p 512,4096 -n 0 -fa 1
  lb 60 $Q -p 0 -n 32 -d 4096 -fa 1
  lb 90 $Q -p 512,4096 -n 0 -fa 1 -ncmoe 24
  lb 90 $Q -p 0 -n 32 -d 4096 -fa 1 -ncmoe 24
  run t512 $Q 512 1,0.5 off,blocking 32
  run t4096 $Q 4096 1,0.5 off,blocking 32
  ;;
C)
  ensure_llama; synth q4_k_m $K; synth iq2_xs $I
  lb 90 $K -p 512 -n 32 -fa 1 -ncmoe 24
  lb 90 $I -p 512 -n 32 -fa 1 -ncmoe 24
  run q4km-half $K 512 0.5 off,blocking 32
  run iq2xs-half $I 512 0.5 off,blocking 32
  ;;
D|E)
  [ "$PART" = D ] && { ensure_llama & LBP=$!; }
  synth iq2_xs $I; synth q4_0 $Q
  for f in iq2xs:$I; do
    STRATA_GPU_TIMING=ops timeout 120 /tmp/cur bench-gpu --model ${f#*:} --prompt 512 --gen 4 --warmup --fracs 1 \
      --modes off --pcie 0 --batch 512 > /tmp/ops.txt 2>&1
    echo "ops ${f%%:*} rc=$?" >> "$L"; echo "== ${f%%:*}" >> "$O/ops.txt"
    grep -E "GPU time by call: 512" /tmp/ops.txt | sed 's/.*GPU time/GPU time/' | tail -2 >> "$O/ops.txt"
  done
  run t4096-g32 $Q 4096 1 off 32
  [ "$PART" = D ] && { wait $LBP; lb 60 $Q -p 0 -n 32,64 -d 4096 -fa 1; lb 90 $Q -p 0 -n 32 -d 4096 -fa 1 -ncmoe 24; }
  env timeout 200 /tmp/cur bench-gpu --model $Q --prompt 4096 --gen 32 --warmup --reps 1 --fracs 0.5 --modes off \
    --pcie 0.33,auto --batch 512 > /tmp/b-half.txt 2>/tmp/b-half.log
  echo "half rc=$? at ${SECONDS}s: $(grep -E '^cache|decode after' /tmp/b-half.txt | tr -s ' ' | tr '\n' '|' | cut -c1-700)" >> "$L"
  { echo "== half"; cat /tmp/b-half.txt; } >> "$O/bench.txt"
  ;;
esac
date >> "$L"; cat "$L"
