#!/usr/bin/env bash
# stop 57 call 1 (issue 18): gpu-check of this build (kernels, the mixed-format stack through Ops::mmv added in
# stop 56, the staging-copy check); the forward pass on tiny-qwen3moe (real vocabulary) for this build and the
# stop-56 build (HEAD 16fa2db): its digests must be equal with the prefill balance off; then prefill with half the
# experts off VRAM (static), 4,096 and 512 prompt tokens: the base, this build with STRATA_GPU_PREFILL_BALANCE=0
# (adjacent RAM places as one copy only) and this build (plus the CPU pool's share), STRATA_GPU_TIMING for the
# last chunk's host time.
set -u
O=${OUT:?}; mkdir -p "$O"; L="$O/log.txt"
. tools/device-env.sh
unxz_to .dev/strata-tools.xz /tmp/cur; unxz_to .dev/strata-tools-base.xz /tmp/base
synth_q4_0 /tmp/cur  # tools/device-env.sh
timeout 200 stdbuf -oL /tmp/cur gpu-check --json "$O/check.json" > "$O/check.txt" 2>/tmp/check.log
echo "gpu-check rc=$? at ${SECONDS}s" >> "$L"; grep -E "panicked|BITS DIFFER|DIFFERS|error" "$O/check.txt" /tmp/check.log | head -5 >> "$L"
grep -E "^staging|worst" "$O/check.txt" >> "$L"
fwd() {  # bin tag [VAR=VALUE ...]
  local b=$1 tag=$2; shift 2
  env "$@" timeout 100 stdbuf -oL /tmp/$b gpu-check --model .dev/tiny-qwen3moe.gguf --forward-only --positions 80 > "$O/fwd-$tag.txt" 2>/tmp/fwd-$tag.log
  echo "fwd $tag rc=$? at ${SECONDS}s" >> "$L"; grep -E "^prefill|panicked" "$O/fwd-$tag.txt" /tmp/fwd-$tag.log | cut -c1-200 >> "$L"
}
fwd cur cur-nobal STRATA_GPU_PREFILL_BALANCE=0; fwd base base; fwd cur cur
wait $SYN
half() {  # bin tag prompt [VAR=VALUE ...]
  local b=$1 tag=$2 p=$3; shift 3
  env STRATA_GPU_TIMING=1 "$@" timeout 100 /tmp/$b bench-gpu --model /tmp/q40.gguf --prompt $p --gen 8 --warmup --reps 3 \
    --fracs 0.5 --modes off --pcie 0 --batch 512 > /tmp/b-$tag.txt 2>/tmp/b-$tag.log
  echo "$tag rc=$? at ${SECONDS}s: $(grep -h 'prompt runs' /tmp/b-$tag.log | head -1) | $(grep -h 'GPU timing: 512 tokens' /tmp/b-$tag.log | tail -1 | sed 's/.*GPU timing: //' | cut -c1-330)" >> "$L"
  grep -E "panicked|ERROR" /tmp/b-$tag.log | head -2 >> "$L"
}
half base base-4096 4096; half cur nobal-4096 4096 STRATA_GPU_PREFILL_BALANCE=0; half cur cur-4096 4096
half base base-512 512; half cur nobal-512 512 STRATA_GPU_PREFILL_BALANCE=0; half cur cur-512 512
date >> "$L"; cat "$L"
