#!/usr/bin/env bash
# stop 51 call 2: which part of the tiled attention change cost time in call 1. One binary (the new build), the kernel
# source chosen by STRATA_KERNEL_SOURCE: v0 HEAD's, v1 call 1's (ldmatrix per pair of slices, exp2, unmasked whole
# tiles), v2 v1 with each step's fragments loaded before its products (and mma not volatile), v4 HEAD's loads with
# exp2 and unmasked whole tiles. bench-gpu --prompt 4096 with STRATA_GPU_TIMING=ops on the Q4_0 qwen3moe file
# (Qwen3-30B-A3B geometry, every expert in VRAM), two rounds.
set -u
O=${OUT:?}; mkdir -p "$O"; L="$O/log.txt"
unxz_to() { python3 -c 'import lzma,shutil,sys; shutil.copyfileobj(lzma.open(sys.argv[1]), open(sys.argv[2],"wb"))' "$1" "$2"; chmod +x "$2"; }
unxz_to .dev/strata-tools-new.xz /tmp/new
for d in /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib $(python3 -c 'import nvidia,os;print(" ".join(os.path.join(p,"cu13","lib") for p in nvidia.__path__))' 2>/dev/null); do
  [ -d "$d" ] && export LD_LIBRARY_PATH="$d:${LD_LIBRARY_PATH:-}"
done
export STRATA_KERNEL_CACHE=/tmp/sk; mkdir -p $STRATA_KERNEL_CACHE
for k in .dev/kc-*.tar.xz; do tar xJf $k -C $STRATA_KERNEL_CACHE; done
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; nproc; grep -m1 'model name' /proc/cpuinfo; date; ls $STRATA_KERNEL_CACHE | wc -l; } >> "$L"
/tmp/new synth-moe --preset qwen3-30b-a3b --type q4_0 --skew 1.0 --arch native --out /tmp/q40.gguf 2>&1 | tail -1 >> "$L"
bench() {  # variant prompt tag
  local v=$1 n=$2 tag=$3
  STRATA_KERNEL_SOURCE=.dev/$v.cu STRATA_GPU_TIMING=ops timeout 100 /tmp/new bench-gpu --model /tmp/q40.gguf --prompt $n --gen 4 \
    --fracs 1 --modes off --pcie 0 --batch 512 > /tmp/b-$tag.txt 2>/tmp/b-$tag.log; local rc=$?
  echo "$tag rc=$rc: $(grep -E '^cache' /tmp/b-$tag.txt | tr -s ' ' | cut -c1-100) | $(grep 'GPU time by call: 512 tokens at 3584' /tmp/b-$tag.log | grep -oE 'attention [0-9.]+ ms' | head -1) | $(grep 'GPU time by call: 512 tokens at 3584' /tmp/b-$tag.log | grep -oE '[0-9.]+ ms in all' | head -1)" >> "$L"
  grep -E "panicked|ERROR|error:|NVRTC" /tmp/b-$tag.log | head -2 >> "$L"
}
for r in 1 2 3; do for v in v0 v1 v2 v4; do bench $v 4096 $v-$r; done; done
date >> "$L"
grep -h "GPU time by call: 512 tokens at 3584" /tmp/b-*.log | cut -c1-400 > "$O/ops.txt"
