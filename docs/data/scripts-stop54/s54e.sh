#!/usr/bin/env bash
# stop 54 call 3 of 3 (right after s54d.sh, the machine still warm): compute-sanitizer memcheck of the new kernels through
# gpu-check, one kernel name filter at a time, 100 s each (the attention one did not finish in that time).
L=$OUT/log.txt; . tools/device-env.sh >/dev/null 2>&1; [ -x /tmp/cur ] || unxz_to .dev/strata-tools.xz /tmp/cur
for k in attention_tiled_p rms_norm_q8_rows; do
  timeout 100 compute-sanitizer --tool memcheck --print-limit 10 --kernel-name kns=$k /tmp/cur gpu-check > /tmp/san-$k.txt 2>&1
  echo "memcheck $k rc=$? at ${SECONDS}s" >> $L; grep -E "ERROR SUMMARY|Invalid|rror" /tmp/san-$k.txt | head -4 >> $L
  grep -E "^(norm|tiled)" /tmp/san-$k.txt | head -3 >> $L
done; cat $L
