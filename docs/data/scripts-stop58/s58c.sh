#!/usr/bin/env bash
# stop 58 call 2 (issue 18; the lean form of s58b.sh, which never got a machine): three launches fewer per decode
# layer (q/k norms with RoPE and the KV store, the f32 router with its top-k, the attention output with the FFN
# norm) and the decode attention's K/V copies of earlier passes started before its wait. gpu-check of this build
# (section 1d: each fused kernel against the launches it replaces, bit for bit), the tiny-qwen3moe forward pass
# (digest); bench-gpu decode with every expert in VRAM after 4,096 and 32 tokens: fused (default),
# STRATA_GPU_FUSE=0 (none of the three), STRATA_GPU_FUSE_NORM=0 (the first two), STRATA_GPU_ATT_PRE=0 (copies
# after the wait); half the experts off VRAM after 512 tokens, fused and not (greedy digests); with LLAMA=1,
# llama.cpp's decode after 4,096 tokens (llama-bench -fa 1, built here meanwhile) and the fused/unfused arms again.
set -u
O=${OUT:?}; mkdir -p "$O"; L="$O/log.txt"
. tools/device-env.sh
unxz_to .dev/strata-tools.xz /tmp/cur
if [ "${LLAMA:-0}" = 1 ]; then build_llama_bench & LBP=$!; fi
( /tmp/cur synth-moe --preset qwen3-30b-a3b --type q4_0 --arch native --out /tmp/q40.gguf 2>&1 | tail -1 >> "$L" ) &
SYN=$!
timeout 200 stdbuf -oL /tmp/cur gpu-check --json "$O/check.json" > "$O/check.txt" 2>/tmp/check.log
echo "gpu-check rc=$? at ${SECONDS}s" >> "$L"; grep -E "panicked|BITS DIFFER|DIFFERS|error|fused" "$O/check.txt" /tmp/check.log | head -5 >> "$L"
timeout 100 stdbuf -oL /tmp/cur gpu-check --model .dev/tiny-qwen3moe.gguf --forward-only --positions 80 > /tmp/fwd.txt 2>&1
echo "fwd rc=$? $(grep -o 'digest [0-9a-f]*' /tmp/fwd.txt | sort | uniq -c | tr '\n' ' ')" >> "$L"
wait $SYN
run() {  # tag prompt fracs gen env...
  local tag=$1 p=$2 fr=$3 g=$4; shift 4
  env "$@" timeout 90 /tmp/cur bench-gpu --model /tmp/q40.gguf --prompt $p --gen $g --warmup --reps 3 --fracs $fr \
    --modes off --pcie 0 --batch 512 > /tmp/b-$tag.txt 2>/tmp/b-$tag.log
  echo "$tag rc=$? at ${SECONDS}s: $(grep -E 'decode after' /tmp/b-$tag.txt | tr -s ' ' | cut -c1-120) $(grep -E '^cache' /tmp/b-$tag.txt | tr -s ' ' | cut -c1-80)" >> "$L"
  grep -E "panicked|ERROR|error:" /tmp/b-$tag.log | head -2 >> "$L"
  cat /tmp/b-$tag.txt >> "$O/bench.txt"
}
run fuse-4096-1 4096 1 64 STRATA_GPU_FUSE=1
run nofuse-4096-1 4096 1 64 STRATA_GPU_FUSE=0
run nonorm-4096-1 4096 1 64 STRATA_GPU_FUSE_NORM=0
run nopre-4096-1 4096 1 64 STRATA_GPU_ATT_PRE=0
run fuse-32-1 32 1 64 STRATA_GPU_FUSE=1
run nofuse-32-1 32 1 64 STRATA_GPU_FUSE=0
run fuse-4096-2 4096 1 64 STRATA_GPU_FUSE=1
run nofuse-4096-2 4096 1 64 STRATA_GPU_FUSE=0
run half-fuse 512 0.5 16 STRATA_GPU_FUSE=1
run half-nofuse 512 0.5 16 STRATA_GPU_FUSE=0
if [ "${LLAMA:-0}" = 1 ]; then
  wait $LBP
  timeout 100 /tmp/lc/llama.cpp/build/bin/llama-bench -m /tmp/q40.gguf -t 16 -ngl 99 -fa 1 -p 0 -n 32 -d 4096 -r 3 \
    -o md 2>/tmp/lb.log | grep "^|" >> "$O/lb.md"
  echo "llama-bench -fa 1 -n 32 -d 4096 rc=$? at ${SECONDS}s: $(tail -1 "$O/lb.md" | tr -s ' ')" >> "$L"
  run fuse-4096-3 4096 1 64 STRATA_GPU_FUSE=1
  run nofuse-4096-3 4096 1 64 STRATA_GPU_FUSE=0
fi
date >> "$L"; cat "$L"
