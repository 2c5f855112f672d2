#!/usr/bin/env bash
# stop 56 call 6 (issue 18): the prefill prefetch (a chunk that reaches nearly every expert uploads the next layer's
# RAM-resident experts while a layer computes) against d68da7c (two binaries, one kernel cache): gpu-check's forward
# pass on a 4-layer cut (its "prefill 64: cache 25%, pcie-prefill" digest must equal the base's), then bench-gpu with
# half the experts off VRAM (static) after 4,096 and 512 prompt tokens: new, new with STRATA_GPU_PREFILL_PREFETCH=0,
# base, each with a warm-up and 3 timed prompts; STRATA_GPU_TIMING for the last chunk's host time.
set -u
O=${OUT:?}; mkdir -p "$O"; L="$O/log.txt"
. tools/device-env.sh
unxz_to .dev/strata-tools.xz /tmp/cur; unxz_to .dev/strata-tools-base.xz /tmp/base
synth_q4_0 /tmp/cur  # tools/device-env.sh
for b in cur base; do
  timeout 100 stdbuf -oL /tmp/$b gpu-check --model /tmp/q4l.gguf --forward-only --positions 80 > "$O/fwd-$b.txt" 2>/tmp/fwd-$b.log
  echo "gpu-check $b rc=$? at ${SECONDS}s" >> "$L"; grep -E "^prefill|panicked" "$O/fwd-$b.txt" /tmp/fwd-$b.log | cut -c1-200 >> "$L"
done
wait $SYN
half() {  # bin tag prompt [VAR=VALUE ...]
  local b=$1 tag=$2 p=$3; shift 3
  env STRATA_GPU_TIMING=1 "$@" timeout 100 /tmp/$b bench-gpu --model /tmp/q40.gguf --prompt $p --gen 8 --warmup --reps 3 \
    --fracs 0.5 --modes off --pcie 0 --batch 512 > /tmp/b-$tag.txt 2>/tmp/b-$tag.log
  echo "$tag rc=$? at ${SECONDS}s: $(grep -h 'prompt runs' /tmp/b-$tag.log | head -1) | $(grep -h 'GPU timing: 512 tokens' /tmp/b-$tag.log | tail -1 | sed 's/.*GPU timing: //' | cut -c1-260)" >> "$L"
  grep -E "panicked|ERROR" /tmp/b-$tag.log | head -2 >> "$L"
}
half cur new-4096 4096; half cur off-4096 4096 STRATA_GPU_PREFILL_PREFETCH=0; half base base-4096 4096
half cur new-512 512; half cur off-512 512 STRATA_GPU_PREFILL_PREFETCH=0; half cur new-4096b 4096
date >> "$L"; cat "$L"
