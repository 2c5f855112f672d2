#!/usr/bin/env bash
# stop 56 call 5 (issue 18): call 2's half-cache static arm (9-17 tok/s) ran in one process after the all-VRAM arm;
# call 4's alone ran at 58-77. The two arms in one process again (fracs 1,0.5), with and without --warmup --reps 3,
# STRATA_GPU_TIMING on (host time per hybrid layer of each decode token).
set -u
O=${OUT:?}; mkdir -p "$O"; L="$O/log.txt"
. tools/device-env.sh
unxz_to .dev/strata-tools.xz /tmp/cur
/tmp/cur synth-moe --preset qwen3-30b-a3b --type q4_0 --arch native --out /tmp/q40.gguf 2>&1 | tail -1 >> "$L"
for arm in "both:" "both-reps:--warmup --reps 3"; do
  tag=${arm%%:*}; a=${arm#*:}
  STRATA_GPU_TIMING=1 timeout 150 /tmp/cur bench-gpu --model /tmp/q40.gguf --prompt 512 $a --gen 32 --fracs 1,0.5 --modes off \
    --pcie 0.33 --batch 512 > /tmp/b-$tag.txt 2>/tmp/b-$tag.log
  echo "== $tag rc=$? at ${SECONDS}s: $(grep -E 'adaptive off|decode after' /tmp/b-$tag.txt | tr -s ' ' | tr '\n' '|')" >> "$L"
  grep -h "GPU timing: 1 tokens" /tmp/b-$tag.log | grep hybrid | sed -n '1,2p;$p' | sed 's/.*GPU timing: //' | cut -c1-330 >> "$L"
  grep -E "panicked|ERROR|WARN" /tmp/b-$tag.log | head -3 >> "$L"
done
cat "$L"
