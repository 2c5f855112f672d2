#!/usr/bin/env bash
# stop 58, written for the next device call (not run: the session's device time ran out). What stop 58's call 2
# could not check: gpu-check section 1d with the attention-output/FFN-norm fusion loaded (STRATA_GPU_FUSE_NORM=1;
# call 2 stopped at the 16-argument limit, now 24), the tiny-qwen3moe forward pass with it (digest
# f81145fab9c42679), bench-gpu decode after 4,096 tokens with every expert in VRAM: the default (two fusions, K/V
# copies before the wait), + the norm fusion, the copies after the wait (STRATA_GPU_ATT_PRE=0), no fusions
# (STRATA_GPU_FUSE=0); half the experts off VRAM after 512 tokens, default and unfused (call 2's unfused greedy
# digest: 226236987cb27015); after 32 tokens, default.
set -u
O=${OUT:?}; mkdir -p "$O"; L="$O/log.txt"
. tools/device-env.sh
unxz_to .dev/strata-tools.xz /tmp/cur
( /tmp/cur synth-moe --preset qwen3-30b-a3b --type q4_0 --arch native --out /tmp/q40.gguf 2>&1 | tail -1 >> "$L" ) &
SYN=$!
STRATA_GPU_FUSE_NORM=1 timeout 150 stdbuf -oL /tmp/cur gpu-check --json "$O/check.json" > "$O/check.txt" 2>/tmp/check.log
echo "gpu-check rc=$? at ${SECONDS}s" >> "$L"; grep -E "panicked|BITS DIFFER|DIFFERS|fused" "$O/check.txt" /tmp/check.log | head -5 >> "$L"
STRATA_GPU_FUSE_NORM=1 timeout 60 stdbuf -oL /tmp/cur gpu-check --model .dev/tiny-qwen3moe.gguf --forward-only --positions 80 > /tmp/fwd.txt 2>&1
echo "fwd rc=$? $(grep -o 'digest [0-9a-f]*' /tmp/fwd.txt | sort | uniq -c | tr '\n' ' ')" >> "$L"
wait $SYN
run() {  # tag prompt fracs gen env...
  local tag=$1 p=$2 fr=$3 g=$4; shift 4
  env "$@" timeout 60 /tmp/cur bench-gpu --model /tmp/q40.gguf --prompt $p --gen $g --warmup --reps 3 --fracs $fr \
    --modes off --pcie 0 --batch 512 > /tmp/b-$tag.txt 2>/tmp/b-$tag.log
  echo "$tag rc=$? at ${SECONDS}s: $(grep -E 'decode after' /tmp/b-$tag.txt | tr -s ' ' | cut -c1-120) $(grep -E '^cache' /tmp/b-$tag.txt | tr -s ' ' | cut -c1-80)" >> "$L"
  grep -E "panicked|ERROR|error:" /tmp/b-$tag.log | head -2 >> "$L"
  cat /tmp/b-$tag.txt >> "$O/bench.txt"
}
for rep in 1 2; do
  run default-4096-$rep 4096 1 64
  run norm-4096-$rep 4096 1 64 STRATA_GPU_FUSE_NORM=1
  run nopre-4096-$rep 4096 1 64 STRATA_GPU_ATT_PRE=0
  run nofuse-4096-$rep 4096 1 64 STRATA_GPU_FUSE=0
done
run half-default 512 0.5 16
run half-norm 512 0.5 16 STRATA_GPU_FUSE_NORM=1
run half-nofuse 512 0.5 16 STRATA_GPU_FUSE=0
run default-32 32 1 64
date >> "$L"; cat "$L"
