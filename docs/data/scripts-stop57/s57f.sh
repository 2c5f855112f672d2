#!/usr/bin/env bash
# stop 57 call 7 (issue 18): the strata arms with the final build (hybrid prefill chunks grouped on the
# device): bench-gpu after 512 and 4,096 prompt tokens (a warm-up and 3 timed prompts), every expert in VRAM and
# half of them off VRAM (static and blocking swaps), decode after each depth (32 tokens); then half off VRAM after
# 4,096 tokens in 2,048-token chunks, and the static arm with STRATA_ARENA_THP=0 (the RAM copy on 4 KiB pages) with
# STRATA_GPU_TIMING's decode lines (where the first decode tokens' time goes).
set -u
O=${OUT:?}; mkdir -p "$O"; L="$O/log.txt"
. tools/device-env.sh
unxz_to .dev/strata-tools.xz /tmp/cur
/tmp/cur synth-moe --preset qwen3-30b-a3b --type q4_0 --arch native --out /tmp/q40.gguf 2>&1 | tail -1 >> "$L"
for P in 512 4096; do
  timeout 70 /tmp/cur bench-gpu --model /tmp/q40.gguf --prompt $P --gen 32 --warmup --reps 3 --fracs 1,0.5 \
    --modes off,blocking --pcie 0 --batch 512 --json "$O/bench-$P.json" > /tmp/b-$P.txt 2>/tmp/b-$P.log
  echo "strata prompt $P rc=$? at ${SECONDS}s" >> "$L"; cat /tmp/b-$P.txt >> "$O/bench.txt"
  grep -h "prompt runs" /tmp/b-$P.log >> "$L"; grep -E "panicked|ERROR|error:" /tmp/b-$P.log | head -2 >> "$L"
done
timeout 40 /tmp/cur bench-gpu --model /tmp/q40.gguf --prompt 4096 --gen 8 --warmup --reps 3 --fracs 0.5 \
  --modes off --pcie 0 --batch 2048 > /tmp/bb.txt 2>/tmp/bb.log
echo "half off, batch 2048 rc=$? at ${SECONDS}s: $(grep -h 'prompt runs' /tmp/bb.log | head -1)" >> "$L"; cat /tmp/bb.txt >> "$O/bench.txt"
STRATA_ARENA_THP=0 STRATA_GPU_TIMING=1 timeout 40 /tmp/cur bench-gpu --model /tmp/q40.gguf --prompt 4096 --gen 16 \
  --reps 1 --fracs 0.5 --modes off --pcie 0 --batch 512 > /tmp/t.txt 2>/tmp/t.log
echo "static, THP off rc=$? at ${SECONDS}s: $(grep -h 'decode after' /tmp/t.txt | tr -s ' ')" >> "$L"
grep -h "GPU timing: 1 tokens" /tmp/t.log | sed 's/.*GPU timing: //' | cut -c1-250 | head -16 > "$O/decode-timing.txt"
date >> "$L"; cat "$L"
