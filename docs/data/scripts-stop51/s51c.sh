#!/usr/bin/env bash
# stop 51 call 3: the final tiled attention (call 2's v2: ldmatrix fragments loaded a step ahead of their products,
# exp2, unmasked whole tiles; the split decode attention's P·V through the same ldmatrix loads). gpu-check of the
# final build (kernel rows against call 1's), bench-gpu --prompt 4096 / 512 --gen 32 on the Q4_0 qwen3moe file
# (Qwen3-30B-A3B geometry, every expert in VRAM) alternating 257fe1e's build (old) and the final one, per-call GPU
# times at 4,096, then compute-sanitizer memcheck over the attention kernels of gpu-check.
set -u
O=${OUT:?}; mkdir -p "$O"; L="$O/log.txt"
unxz_to() { python3 -c 'import lzma,shutil,sys; shutil.copyfileobj(lzma.open(sys.argv[1]), open(sys.argv[2],"wb"))' "$1" "$2"; chmod +x "$2"; }
unxz_to .dev/strata-tools-old.xz /tmp/old; unxz_to .dev/strata-tools-fin.xz /tmp/fin
for d in /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib $(python3 -c 'import nvidia,os;print(" ".join(os.path.join(p,"cu13","lib") for p in nvidia.__path__))' 2>/dev/null); do
  [ -d "$d" ] && export LD_LIBRARY_PATH="$d:${LD_LIBRARY_PATH:-}"
done
export STRATA_KERNEL_CACHE=/tmp/sk; mkdir -p $STRATA_KERNEL_CACHE
for k in .dev/kc-*.tar.xz; do tar xJf $k -C $STRATA_KERNEL_CACHE; done
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; nproc; grep -m1 'model name' /proc/cpuinfo; date; ls $STRATA_KERNEL_CACHE | wc -l; } >> "$L"
( /tmp/fin synth-moe --preset qwen3-30b-a3b --type q4_0 --skew 1.0 --arch native --out /tmp/q40.gguf 2>&1 | tail -1 >> "$L" ) &
SYN=$!
timeout 200 /tmp/fin gpu-check --json "$O/check-fin.json" > "$O/check-fin.txt" 2>/tmp/check-fin.log; echo "gpu-check fin rc=$? $(date +%T)" >> "$L"
norm() { grep -E '^(Q|IQ|F|BF|MXFP|mmq|stack|split|expert|tiled|attn)' "$1" | grep -vE 'ms|tok/s' ; }
norm docs/data/stop51-call1-h100-check-new.txt > /tmp/k1.txt; norm "$O/check-fin.txt" > /tmp/k3.txt
echo "kernel rows: $(wc -l < /tmp/k1.txt) in call 1, $(wc -l < /tmp/k3.txt) now; differing: $(diff /tmp/k1.txt /tmp/k3.txt | grep -c '^[<>]')" >> "$L"
diff /tmp/k1.txt /tmp/k3.txt > "$O/check-diff.txt"
grep -iE "worst|fail|panick" "$O/check-fin.txt" /tmp/check-fin.log | head -5 >> "$L"
wait $SYN; date >> "$L"
bench() {  # build file prompt gen tag [env]
  local v=$1 f=$2 n=$3 g=$4 tag=$5; shift 5
  env "$@" timeout 100 /tmp/$v bench-gpu --model $f --prompt $n --gen $g --fracs 1 --modes off --pcie 0 --batch 512 \
    --json "/tmp/b-$tag.json" > /tmp/b-$tag.txt 2>/tmp/b-$tag.log; local rc=$?
  echo "$tag rc=$rc: $(grep -E '^cache|decode after' /tmp/b-$tag.txt | tr -s ' ' | tr '\n' '|' | cut -c1-400)" >> "$L"
  grep -E "panicked|ERROR|error:" /tmp/b-$tag.log | head -2 >> "$L"
}
for r in 1 2; do
  for v in old fin; do bench $v /tmp/q40.gguf 4096 32 q40-4096-$v-$r; done
  for v in old fin; do bench $v /tmp/q40.gguf 512 32 q40-512-$v-$r; done
done
bench fin /tmp/q40.gguf 4096 4 q40-ops-fin STRATA_GPU_TIMING=ops
grep -h "GPU time by call" /tmp/b-q40-ops-fin.log | cut -c1-400 > "$O/ops.txt"
cat /tmp/b-*.txt > "$O/bench.txt"; for f in /tmp/b-*.json; do echo "$(basename $f) $(cat $f)"; done > "$O/bench.jsonl"
date >> "$L"
left=$((500 - SECONDS)); echo "sanitizer with ${left}s left" >> "$L"
[ $left -gt 30 ] && { timeout $left compute-sanitizer --tool memcheck --print-limit 10 --kernel-name kns=attention \
  /tmp/fin gpu-check > /tmp/san.txt 2>&1; echo "memcheck attention kernels rc=$? $(date +%T)" >> "$L"
  grep -E "ERROR SUMMARY|Invalid" /tmp/san.txt | head -5 >> "$L"; grep -E "^(tiled|split|attn)" /tmp/san.txt | head -40 > "$O/san-rows.txt"; tail -3 /tmp/san.txt >> "$O/san-rows.txt"; }
date >> "$L"
