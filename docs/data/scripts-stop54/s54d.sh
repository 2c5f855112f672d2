#!/usr/bin/env bash
# stop 54 call 2 of 3 that ran (a longer plan with a llama.cpp build and per-kernel profiles of both engines was cut to the
# device time left after failed starts): this
# stop's prefill kernels beside the start's in one binary. "old" = STRATA_GPU_FA_PIPE=0 STRATA_GPU_NORM_ROWS=0 (the
# tiled attention loading each K/V tile before its products, the norms as 8-block clusters per row), "new" = the
# defaults (attention_tiled_p_*, rms_norm_q8_rows for prefill chunks). gpu-check of the new kernels (kernel rows
# against stop 53's; the norm rows also compare the two norm kernels' bytes), bench-gpu alternating (Q4_0
# Qwen3-30B-A3B geometry, every expert in VRAM, prompts 4,096 and 512), per-call GPU times, then memcheck of the new
# kernels with the time left.
set -u
B=${BUDGET:-280}
O=${OUT:?}; mkdir -p "$O"; L="$O/log.txt"
. tools/device-env.sh
unxz_to .dev/strata-tools.xz /tmp/cur
( /tmp/cur synth-moe --preset qwen3-30b-a3b --type q4_0 --skew 1.0 --arch native --out /tmp/q40.gguf 2>&1 | tail -1 >> "$L" ) &
SYN=$!
OLD=(STRATA_GPU_FA_PIPE=0 STRATA_GPU_NORM_ROWS=0); NEW=(STRATA_NEW=1)
timeout 120 /tmp/cur gpu-check --json "$O/check-new.json" > "$O/check-new.txt" 2>/tmp/check-new.log; echo "gpu-check new rc=$? at ${SECONDS}s" >> "$L"
norm() { grep -E '^(Q|IQ|F|BF|MXFP|mmq|stack|split|expert|tiled|attn|norm)' "$1" | grep -vE 'ms|tok/s' ; }
# the start's kernels give stop 53's rows (its gpu-check ran them on an H100: the same sm_90 code)
norm docs/data/stop53-call1-h100-check-new.txt > /tmp/k53.txt; norm "$O/check-new.txt" > /tmp/k1.txt
echo "kernel rows: stop 53 $(wc -l < /tmp/k53.txt), new $(wc -l < /tmp/k1.txt), differing $(diff /tmp/k53.txt /tmp/k1.txt | grep -c '^[<>]')" >> "$L"
diff /tmp/k53.txt /tmp/k1.txt > "$O/check-diff.txt"
grep -iE "worst|fail|panick|DIFFERS" "$O/check-new.txt" /tmp/check-new.log | head -5 >> "$L"
wait $SYN
bench() {  # old|new prompt gen tag [env]
  local v=$1 n=$2 g=$3 tag=$4; shift 4
  local -a e=("${NEW[@]}"); [ $v = old ] && e=("${OLD[@]}")
  env "${e[@]}" "$@" timeout 60 /tmp/cur bench-gpu --model /tmp/q40.gguf --prompt $n --gen $g --fracs 1 --modes off --pcie 0 --batch 512 \
    > /tmp/b-$tag.txt 2>/tmp/b-$tag.log; local rc=$?
  echo "$tag rc=$rc at ${SECONDS}s: $(grep -E '^cache|decode after' /tmp/b-$tag.txt | tr -s ' ' | tr '\n' '|' | cut -c1-300)" >> "$L"
  grep -E "panicked|ERROR|error:" /tmp/b-$tag.log | head -2 >> "$L"
}
for v in old new; do bench $v 4096 4 ops-$v STRATA_GPU_TIMING=ops; grep -h "GPU time by call" /tmp/b-ops-$v.log | cut -c1-900 > "$O/ops-$v.txt"; done
for r in 1 2; do for v in old new; do [ $SECONDS -lt $((B - 40)) ] && bench $v 4096 32 4096-$v-$r; done; done
for v in old new; do [ $SECONDS -lt $((B - 40)) ] && bench $v 512 32 512-$v-1; done
cat /tmp/b-*.txt > "$O/bench.txt"
left=$((B - 5 - SECONDS)); echo "memcheck with ${left}s left" >> "$L"
[ $left -gt 25 ] && { timeout $left compute-sanitizer --tool memcheck --print-limit 10 --kernel-name "regex:rms_norm_q8_rows|attention_tiled_p" \
  /tmp/cur gpu-check > /tmp/san.txt 2>&1; echo "memcheck rc=$? at ${SECONDS}s" >> "$L"; grep -E "ERROR SUMMARY|Invalid|norm .*51|tiled" /tmp/san.txt | head -8 >> "$L"; }
date >> "$L"
