#!/usr/bin/env bash
# stop 59 (issues 18, 19; PART=1 ran as call 1; the norm fusion it names was removed after it), in two calls, each short enough to come back when a lease is cut short (two calls of
# one script doing both were taken back mid-run with nothing returned). Ran stop 58's build (c135ed9); a later run needs
# .dev/strata-tools.xz and .dev/kc-*.tar.xz rebuilt for the current source (the kernel cache key is the .cu text).
# PART=1: gpu-check with the attention-output/FFN-norm fusion loaded (section 1d bit comparisons), the tiny-qwen3moe
#   forward pass (digest f81145fab9c42679), decode after 4,096 tokens with every expert in VRAM: default, + norm
#   fusion, copies after the wait, no fusions; half the experts off VRAM (static) with and without the fusions;
#   compute-sanitizer memcheck over the tiny-qwen3moe forward pass with every fused kernel on.
# PART=3 (no llama.cpp: too little device time left for its build): PART=2's strata arms alone.
# PART=2 (on the machine PART=1 left warm, or a fresh one): llama.cpp built meanwhile the Q4_K_M file's strata arms
#   run (every expert in VRAM: GPU-bound, but beside a 16-job build: say so with their figures); then, nothing else running, llama-bench -fa 1 and strata bench-gpu on
#   the issue's table (all in VRAM and half off, prefill 512 / 4,096 and decode after them), llama-bench on Q4_K_M.
set -u
O=${OUT:?}; mkdir -p "$O"; L="$O/log.txt"
. tools/device-env.sh
[ -x /tmp/cur ] || unxz_to .dev/strata-tools.xz /tmp/cur
synth() {  # type path
  [ -s $2 ] || { /tmp/cur synth-moe --preset qwen3-30b-a3b --type $1 --arch native --out $2.part 2>&1 | tail -1 >> "$L"
    mv $2.part $2; }  # a file cut off by a lost lease is never taken for a whole one
}
run() {  # tag model prompt fracs modes gen env...
  local tag=$1 m=$2 p=$3 fr=$4 md=$5 g=$6; shift 6
  env "$@" timeout 120 /tmp/cur bench-gpu --model $m --prompt $p --gen $g --warmup --reps 3 --fracs $fr \
    --modes $md --pcie 0 --batch 512 > /tmp/b-$tag.txt 2>/tmp/b-$tag.log
  echo "$tag rc=$? at ${SECONDS}s: $(grep -E '^cache|decode after' /tmp/b-$tag.txt | tr -s ' ' | tr '\n' '|' | cut -c1-400) $(grep -h 'prompt runs' /tmp/b-$tag.log | tr '\n' ' ')" >> "$L"
  grep -E "panicked|ERROR|error:" /tmp/b-$tag.log | head -2 >> "$L"
  { echo "== $tag"; cat /tmp/b-$tag.txt; } >> "$O/bench.txt"
}
Q=/tmp/q40.gguf; K=/tmp/q4km.gguf
if [ "${PART:-1}" = 1 ]; then
  synth q4_0 $Q & SYN=$!
  STRATA_GPU_FUSE_NORM=1 timeout 150 stdbuf -oL /tmp/cur gpu-check --json "$O/check.json" > "$O/check.txt" 2>/tmp/check.log
  echo "gpu-check rc=$? at ${SECONDS}s" >> "$L"; grep -E "panicked|BITS DIFFER|DIFFERS|fused" "$O/check.txt" /tmp/check.log | head -8 >> "$L"
  STRATA_GPU_FUSE_NORM=1 timeout 60 stdbuf -oL /tmp/cur gpu-check --model .dev/tiny-qwen3moe.gguf --forward-only --positions 80 > /tmp/fwd.txt 2>&1
  echo "fwd rc=$? $(grep -o 'digest [0-9a-f]*' /tmp/fwd.txt | sort | uniq -c | tr '\n' ' ')" >> "$L"
  wait $SYN
  run default-a $Q 4096 1 off 64
  run norm-a $Q 4096 1 off 64 STRATA_GPU_FUSE_NORM=1
  run nopre-a $Q 4096 1 off 64 STRATA_GPU_ATT_PRE=0
  run nofuse-a $Q 4096 1 off 64 STRATA_GPU_FUSE=0
  run half-default $Q 4096 0.5 off 32
  run half-nofuse $Q 4096 0.5 off 32 STRATA_GPU_FUSE=0
  STRATA_GPU_FUSE_NORM=1 timeout 60 compute-sanitizer --tool memcheck --print-limit 10 /tmp/cur gpu-check \
    --model .dev/tiny-qwen3moe.gguf --forward-only --positions 40 > "$O/sanitizer.txt" 2>&1
  echo "sanitizer rc=$? at ${SECONDS}s: $(grep -E 'ERROR SUMMARY|digest' "$O/sanitizer.txt" | tr '\n' ' ' | cut -c1-300)" >> "$L"
elif [ "${PART}" = 3 ]; then
  synth q4_0 $Q; synth q4_k_m $K
  run q4km $K 512 1 off 32
  run q4km-nofuse $K 512 1 off 32 STRATA_GPU_FUSE=0
  run t512 $Q 512 1,0.5 off,blocking 32
  run t4096 $Q 4096 1,0.5 off,blocking 32
else
  build_llama_bench & LBP=$!
  synth q4_0 $Q; synth q4_k_m $K
  run q4km $K 512 1 off 32
  run q4km-nofuse $K 512 1 off 32 STRATA_GPU_FUSE=0
  wait $LBP
  LB=/tmp/lc/llama.cpp/build/bin/llama-bench
  lb() {  # each run's rows in a file of its own, its own return code
    local t=$1 m=$2; shift 2; timeout $t $LB -m $m -t 16 -ngl 99 "$@" -o md > /tmp/lb1.md 2>/tmp/lb.log; local rc=$?
    grep "^|" /tmp/lb1.md >> "$O/lb.md"; echo "llama-bench $* rc=$rc at ${SECONDS}s: $(grep '^|' /tmp/lb1.md | tail -1 | tr -s ' ')" >> "$L"; }
  lb 60 $Q -p 512,4096 -n 0 -fa 1
  lb 60 $Q -p 0 -n 32 -d 4096 -fa 1
  lb 90 $Q -p 512,4096 -n 0 -fa 1 -ncmoe 24
  lb 90 $Q -p 0 -n 32 -d 4096 -fa 1 -ncmoe 24
  run t512 $Q 512 1,0.5 off,blocking 32
  run t4096 $Q 4096 1,0.5 off,blocking 32
  [ $SECONDS -lt 530 ] && lb 50 $K -p 512 -n 32 -fa 1
fi
date >> "$L"; cat "$L"
