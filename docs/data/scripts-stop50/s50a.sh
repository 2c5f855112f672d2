#!/usr/bin/env bash
# stop 50 call 1: the pipelined tensor-core loop for every format but MXFP4 (Q6_K, Q3_K, Q5_0/Q5_1, IQ4_NL/IQ4_XS, the
# lattice IQ formats; rows that start 2-byte aligned copied as whole words). gpu-check of the new build (kernel rows
# against stop 49 call 1's, which 536016f must also reproduce), bench-gpu prefill 512 / decode 64 on the Q4_K_M and
# IQ2_XS qwen3moe files (Qwen3-30B-A3B geometry, every expert in VRAM) alternating HEAD's build (old) and the new one,
# per-call GPU times, then compute-sanitizer memcheck over the tensor-core kernels of gpu-check and a tiny Q6_K model.
set -u
O=${OUT:?}; mkdir -p "$O"; L="$O/log.txt"
unxz_to() { python3 -c 'import lzma,shutil,sys; shutil.copyfileobj(lzma.open(sys.argv[1]), open(sys.argv[2],"wb"))' "$1" "$2"; chmod +x "$2"; }
unxz_to .dev/strata-tools-old.xz /tmp/old; unxz_to .dev/strata-tools-new.xz /tmp/new
for d in /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib $(python3 -c 'import nvidia,os;print(" ".join(os.path.join(p,"cu13","lib") for p in nvidia.__path__))' 2>/dev/null); do
  [ -d "$d" ] && export LD_LIBRARY_PATH="$d:${LD_LIBRARY_PATH:-}"
done
export STRATA_KERNEL_CACHE=/tmp/sk; mkdir -p $STRATA_KERNEL_CACHE
for k in .dev/kc-*.tar.xz; do tar xJf $k -C $STRATA_KERNEL_CACHE; done
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; nproc; grep -m1 'model name' /proc/cpuinfo; date; ls $STRATA_KERNEL_CACHE | wc -l; } >> "$L"
( /tmp/new synth-moe --preset qwen3-30b-a3b --type q4_k_m --skew 1.0 --arch native --out /tmp/q4km.gguf 2>&1 | tail -1 >> "$L"
  /tmp/new synth-moe --preset qwen3-30b-a3b --type iq2_xs --skew 1.0 --arch native --out /tmp/iq2xs.gguf 2>&1 | tail -1 >> "$L"
  /tmp/new synth-moe --preset tiny --type q6_k --arch native --seed 3 --out /tmp/tiny-q6k.gguf 2>&1 | tail -1 >> "$L" ) &
timeout 240 /tmp/new gpu-check --json "$O/check-new.json" > "$O/check-new.txt" 2>/tmp/check-new.log; echo "gpu-check new rc=$? $(date +%T)" >> "$L"
# the kernel rows (format, shape, errors) against stop 49's call 1 (5a1ff72's successor, the same bits as 536016f)
norm() { grep -E '^(Q|IQ|F|BF|MXFP|mmq|stack|split|expert)' "$1" | grep -vE 'ms|tok/s' ; }
norm docs/data/stop49-call1-h100-check-new.txt > /tmp/k49.txt; norm "$O/check-new.txt" > /tmp/k50.txt
echo "kernel rows: $(wc -l < /tmp/k49.txt) in stop 49, $(wc -l < /tmp/k50.txt) now; differing: $(diff /tmp/k49.txt /tmp/k50.txt | grep -c '^[<>]')" >> "$L"
diff /tmp/k49.txt /tmp/k50.txt > "$O/check-diff.txt"
grep -iE "worst|fail|panick" "$O/check-new.txt" /tmp/check-new.log | head -5 >> "$L"
wait; date >> "$L"
bench() {  # build file prompt gen tag [env]
  local v=$1 f=$2 n=$3 g=$4 tag=$5; shift 5
  env "$@" timeout 150 /tmp/$v bench-gpu --model $f --prompt $n --gen $g --fracs 1 --modes off --pcie 0 --batch 512 \
    --json "/tmp/b-$tag.json" > /tmp/b-$tag.txt 2>/tmp/b-$tag.log; local rc=$?
  echo "$tag rc=$rc: $(grep -E '^cache|decode after' /tmp/b-$tag.txt | tr -s ' ' | tr '\n' '|' | cut -c1-400)" >> "$L"
  grep -E "panicked|ERROR|error:" /tmp/b-$tag.log | head -2 >> "$L"
}
for r in 1 2; do
  for v in old new; do bench $v /tmp/q4km.gguf 512 64 q4km-512-$v-$r; done
  for v in old new; do bench $v /tmp/iq2xs.gguf 512 64 iq2xs-512-$v-$r; done
done
date >> "$L"
bench new /tmp/q4km.gguf 512 8 q4km-ops STRATA_GPU_TIMING=ops
bench old /tmp/q4km.gguf 512 8 q4km-ops-old STRATA_GPU_TIMING=ops
bench new /tmp/iq2xs.gguf 512 8 iq2xs-ops STRATA_GPU_TIMING=ops
grep -h "GPU time by call" /tmp/b-q4km-ops.log /tmp/b-q4km-ops-old.log /tmp/b-iq2xs-ops.log | cut -c1-700 > "$O/ops.txt"
cat /tmp/b-*.txt > "$O/bench.txt"; for f in /tmp/b-*.json; do echo "$(basename $f) $(cat $f)"; done > "$O/bench.jsonl"
date >> "$L"
left=$((560 - SECONDS)); echo "sanitizer with ${left}s left" >> "$L"
if [ $left -gt 60 ]; then
  timeout $((left / 2)) compute-sanitizer --tool memcheck --print-limit 10 --kernel-name regex:mmq /tmp/new gpu-check \
    > "$O/san-kernels.txt" 2>&1; echo "memcheck mmq kernels rc=$?" >> "$L"
  grep -E "ERROR SUMMARY|Invalid" "$O/san-kernels.txt" | head -5 >> "$L"
  left=$((570 - SECONDS))
  [ $left -gt 20 ] && { timeout $left compute-sanitizer --tool memcheck --print-limit 10 /tmp/new gpu-check \
    --model /tmp/tiny-q6k.gguf --positions 24 --forward-only > "$O/san-q6k.txt" 2>&1; echo "memcheck tiny q6_k rc=$?" >> "$L"
    grep -E "ERROR SUMMARY|Invalid" "$O/san-q6k.txt" | head -5 >> "$L"; }
fi
date >> "$L"
