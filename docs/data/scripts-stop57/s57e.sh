#!/usr/bin/env bash
# stop 57 call 6 (issue 18): a hybrid prefill chunk groups its GPU experts on the device and runs them on the
# tensor-core expert kernels (as an all-VRAM chunk). The forward pass on tiny-qwen3moe (its digests must equal the
# stop-56 build's, f81145fab9c42679, printed in calls 1, 3 and 4), then prefill with half the experts off VRAM
# (static) after 512 tokens in 512-token chunks and after 4,096 tokens in 512-, 2,048- and 4,096-token chunks
# (--batch), STRATA_GPU_TIMING for the last chunk's host time, with the greedy tokens' digest of each arm.
set -u
O=${OUT:?}; mkdir -p "$O"; L="$O/log.txt"
. tools/device-env.sh
unxz_to .dev/strata-tools.xz /tmp/cur
( /tmp/cur synth-moe --preset qwen3-30b-a3b --type q4_0 --arch native --out /tmp/q40.gguf 2>&1 | tail -1 >> "$L" ) &
SYN=$!
for v in 1 0; do
  STRATA_GPU_GROUP=$v timeout 100 stdbuf -oL /tmp/cur gpu-check --model .dev/tiny-qwen3moe.gguf --forward-only --positions 80 > "$O/fwd-$v.txt" 2>/tmp/fwd-$v.log
  echo "fwd STRATA_GPU_GROUP=$v rc=$? at ${SECONDS}s" >> "$L"; grep -E "^prefill|panicked" "$O/fwd-$v.txt" /tmp/fwd-$v.log | cut -c1-200 >> "$L"
done
wait $SYN
half() {  # tag prompt batch [VAR=VALUE ...]
  local tag=$1 p=$2 bt=$3; shift 3
  env STRATA_GPU_TIMING=1 "$@" timeout 100 /tmp/cur bench-gpu --model /tmp/q40.gguf --prompt $p --gen 8 --warmup --reps 3 \
    --fracs 0.5 --modes off --pcie 0 --batch $bt > /tmp/b-$tag.txt 2>/tmp/b-$tag.log
  echo "$tag rc=$? at ${SECONDS}s: $(grep -h 'prompt runs' /tmp/b-$tag.log | head -1) | $(grep -h 'GPU timing: [0-9]* tokens' /tmp/b-$tag.log | tail -1 | sed 's/.*GPU timing: //' | cut -c1-330)" >> "$L"
  echo "   $(grep -h 'tokens [0-9a-f]\{16\}' /tmp/b-$tag.txt /tmp/b-$tag.log | head -1 | sed 's/.*tokens //')" >> "$L"
  grep -E "panicked|ERROR" /tmp/b-$tag.log | head -2 >> "$L"
}
half p512-b512 512 512; half p4096-b512 4096 512; half p4096-b2048 4096 2048; half p4096-b4096 4096 4096
half p4096-b4096-nogroup 4096 4096 STRATA_GPU_GROUP=0
date >> "$L"; cat "$L"
