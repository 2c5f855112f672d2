#!/usr/bin/env bash
# stop 57 calls 3-4 (issue 18): prefill ahead (two staging sets; a prefill layer uploads the next layer's RAM-resident
# experts on the prefetch stream while it computes). gpu-check of this build (kernels, staging copies); the forward
# pass on tiny-qwen3moe for this build, for it with STRATA_GPU_PREFILL_AHEAD=0 and for the stop-56 build (the
# digests must be equal); then prefill with half the experts off VRAM (static): the base, this build with the
# ahead off, this build, after 512 and 4,096 prompt tokens, STRATA_GPU_TIMING for the last chunk's host time, and
# the greedy tokens' digest of each arm.
set -u
O=${OUT:?}; mkdir -p "$O"; L="$O/log.txt"
. tools/device-env.sh
unxz_to .dev/strata-tools.xz /tmp/cur; unxz_to .dev/strata-tools-base.xz /tmp/base
synth_q4_0 /tmp/cur  # tools/device-env.sh
if [ "${CHECK:-1}" = 1 ]; then  # CHECK=0: without gpu-check (call 4: its kernels and staging copies as call 3's)
  timeout 200 stdbuf -oL /tmp/cur gpu-check --json "$O/check.json" > "$O/check.txt" 2>/tmp/check.log
  echo "gpu-check rc=$? at ${SECONDS}s" >> "$L"; grep -E "panicked|BITS DIFFER|DIFFERS|error" "$O/check.txt" /tmp/check.log | head -5 >> "$L"
  grep -E "^staging" "$O/check.txt" >> "$L"
fi
fwd() {  # bin tag [VAR=VALUE ...]
  local b=$1 tag=$2; shift 2
  env "$@" timeout 100 stdbuf -oL /tmp/$b gpu-check --model .dev/tiny-qwen3moe.gguf --forward-only --positions 80 > "$O/fwd-$tag.txt" 2>/tmp/fwd-$tag.log
  echo "fwd $tag rc=$? at ${SECONDS}s" >> "$L"; grep -E "^prefill|panicked" "$O/fwd-$tag.txt" /tmp/fwd-$tag.log | cut -c1-200 >> "$L"
  grep -h "staging slots" /tmp/fwd-$tag.log | head -1 | cut -c1-200 >> "$L"
}
fwd cur cur; fwd cur noahead STRATA_GPU_PREFILL_AHEAD=0; fwd base base
wait $SYN
half() {  # bin tag prompt [VAR=VALUE ...]
  local b=$1 tag=$2 p=$3; shift 3
  env STRATA_GPU_TIMING=1 "$@" timeout 100 /tmp/$b bench-gpu --model /tmp/q40.gguf --prompt $p --gen 8 --warmup --reps 3 \
    --fracs 0.5 --modes off --pcie 0 --batch 512 > /tmp/b-$tag.txt 2>/tmp/b-$tag.log
  echo "$tag rc=$? at ${SECONDS}s: $(grep -h 'prompt runs' /tmp/b-$tag.log | head -1) | $(grep -h 'GPU timing: 512 tokens' /tmp/b-$tag.log | tail -1 | sed 's/.*GPU timing: //' | cut -c1-330)" >> "$L"
  echo "   $(grep -h 'tokens [0-9a-f]\{16\}' /tmp/b-$tag.txt /tmp/b-$tag.log | head -1 | sed 's/.*tokens //') $(grep -h 'staging slots' /tmp/b-$tag.log | head -1 | grep -o '+ [0-9]* staging slots')" >> "$L"
  grep -E "panicked|ERROR" /tmp/b-$tag.log | head -2 >> "$L"
}
half base base-512 512; half cur noahead-512 512 STRATA_GPU_PREFILL_AHEAD=0; half cur cur-512 512
half base base-4096 4096; half cur cur-4096 4096
date >> "$L"; cat "$L"
