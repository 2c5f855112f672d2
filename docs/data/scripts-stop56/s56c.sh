#!/usr/bin/env bash
# stop 56 call 3 (issue 18): why decode with half the experts off VRAM and a static placement ran at 9-17 tok/s in
# call 2 where llama.cpp's -ncmoe 24 ran at 89: the host's CPU layout, then bench-gpu's half-cache static arm with
# STRATA_GPU_TIMING (host time per hybrid layer: waiting for the routing, planning, CPU experts) with the process
# on all 16 CPUs (16 pool threads), on 15 and on 8 (taskset; the pool takes the CPUs it may run on).
set -u
O=${OUT:?}; mkdir -p "$O"; L="$O/log.txt"
. tools/device-env.sh
unxz_to .dev/strata-tools.xz /tmp/cur
{ lscpu | grep -E "^(CPU\(s\)|Thread|Core|Socket|NUMA|Model name|L3)"; numactl -H 2>/dev/null | head -3; } >> "$L"
/tmp/cur synth-moe --preset qwen3-30b-a3b --type q4_0 --arch native --out /tmp/q40.gguf 2>&1 | tail -1 >> "$L"
for arm in "all:" "c15:taskset -c 0-14" "c8:taskset -c 0-7" "all-again:"; do
  tag=${arm%%:*}; ts=${arm#*:}
  STRATA_GPU_TIMING=1 timeout 120 $ts /tmp/cur bench-gpu --model /tmp/q40.gguf --prompt 64 --gen 32 --fracs 0.5 --modes off \
    --pcie 0 --batch 512 > /tmp/b-$tag.txt 2>/tmp/b-$tag.log
  echo "== $tag rc=$? at ${SECONDS}s: $(grep -h 'CPU threads' /tmp/b-$tag.log | sed 's/.*(//') $(grep -E 'decode after' /tmp/b-$tag.txt | tr -s ' ')" >> "$L"
  grep -h "GPU timing: 1 tokens" /tmp/b-$tag.log | tail -3 | sed 's/.*GPU timing: //' >> "$L"
  grep -E "panicked|ERROR" /tmp/b-$tag.log | head -2 >> "$L"
done
cat "$L"
