#!/usr/bin/env bash
# stop 56 call 4 (issue 18): call 3 decoded the half-cache static arm at 73-84 tok/s after 64 prompt tokens, call 2 at
# 9-17 after 512 and 4,096: the same arm with STRATA_GPU_TIMING after 4,096 and 512 prompt tokens, with and without
# bench-gpu's --warmup --reps 3 (host time per hybrid layer of each decode token).
set -u
O=${OUT:?}; mkdir -p "$O"; L="$O/log.txt"
. tools/device-env.sh
unxz_to .dev/strata-tools.xz /tmp/cur
/tmp/cur synth-moe --preset qwen3-30b-a3b --type q4_0 --arch native --out /tmp/q40.gguf 2>&1 | tail -1 >> "$L"
for arm in "p4096:--prompt 4096" "p4096-reps:--prompt 4096 --warmup --reps 3" "p512:--prompt 512"; do
  tag=${arm%%:*}; a=${arm#*:}
  STRATA_GPU_TIMING=1 timeout 150 /tmp/cur bench-gpu --model /tmp/q40.gguf $a --gen 32 --fracs 0.5 --modes off \
    --pcie 0 --batch 512 > /tmp/b-$tag.txt 2>/tmp/b-$tag.log
  echo "== $tag rc=$? at ${SECONDS}s: $(grep -E 'adaptive off|decode after' /tmp/b-$tag.txt | tr -s ' ' | tr '\n' '|')" >> "$L"
  grep -h "GPU timing: 1 tokens" /tmp/b-$tag.log | sed -n '1,2p;$p' | sed 's/.*GPU timing: //' >> "$L"
  grep -h "GPU timing: 512 tokens" /tmp/b-$tag.log | tail -1 | sed 's/.*GPU timing: //' >> "$L"
  grep -E "panicked|ERROR|WARN" /tmp/b-$tag.log | head -3 >> "$L"
done
cat "$L"
