#!/usr/bin/env bash
# stop 59 call 2 (issue 18), run inline on the machine s59b.sh PART=1 left warm (its /tmp/cur and /tmp/q40.gguf):
# a second run of decode after 4,096 tokens with every expert in VRAM, with the norm fusion, the default, and the
# K/V copies after the wait.
O=$OUT; L=$O/log.txt; . tools/device-env.sh; ls -la /tmp/q40.gguf /tmp/cur >> $L 2>&1
for a in "norm STRATA_GPU_FUSE_NORM=1" "default X=1" "nopre STRATA_GPU_ATT_PRE=0"; do
  set -- $a
  env $2 timeout 30 /tmp/cur bench-gpu --model /tmp/q40.gguf --prompt 4096 --gen 64 --warmup --reps 3 --fracs 1 \
    --modes off --pcie 0 --batch 512 > /tmp/x.txt 2>&1
  echo "$1 rc=$? at ${SECONDS}s: $(grep -E '^cache|decode after' /tmp/x.txt | tr -s ' ' | tr '\n' '|' | cut -c1-200)" >> $L
done
cat $L
