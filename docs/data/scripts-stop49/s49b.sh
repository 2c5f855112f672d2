#!/usr/bin/env bash
# stop 49 call 2: the sub-block formats' one-token expert kernels read every row of a warp together and have narrow
# variants (Q4_K_M, IQ2_XS). gpu-check of the new build (its kernel rows against call 1's old ones, by diff here),
# then bench-gpu (prefill 512, decode 64, every expert in VRAM) alternating HEAD's build, the new build and the new
# build with STRATA_GPU_NARROW=0.
set -u
O=${OUT:?}; mkdir -p "$O"; L="$O/log.txt"
unxz_to() { python3 -c 'import lzma,shutil,sys; shutil.copyfileobj(lzma.open(sys.argv[1]), open(sys.argv[2],"wb"))' "$1" "$2"; chmod +x "$2"; }
unxz_to .dev/strata-tools-old.xz /tmp/old; unxz_to .dev/strata-tools-new.xz /tmp/new; unxz_to .dev/exact3.gguf.xz /tmp/fx.gguf
for d in /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib $(python3 -c 'import nvidia,os;print(" ".join(os.path.join(p,"cu13","lib") for p in nvidia.__path__))' 2>/dev/null); do
  [ -d "$d" ] && export LD_LIBRARY_PATH="$d:${LD_LIBRARY_PATH:-}"
done
export STRATA_KERNEL_CACHE=/tmp/sk; mkdir -p $STRATA_KERNEL_CACHE
tar xJf .dev/kc.tar.xz -C $STRATA_KERNEL_CACHE; tar xJf .dev/kc-new.tar.xz -C $STRATA_KERNEL_CACHE
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; nproc; grep -m1 'model name' /proc/cpuinfo; date; } >> "$L"
( /tmp/new synth-moe --preset qwen3-30b-a3b --type q4_k_m --skew 1.0 --arch native --out /tmp/q4km.gguf 2>&1 | tail -1 >> "$L"
  /tmp/new synth-moe --preset qwen3-30b-a3b --type iq2_xs --skew 1.0 --arch native --out /tmp/iq2xs.gguf 2>&1 | tail -1 >> "$L" ) &
timeout 200 /tmp/new gpu-check --model /tmp/fx.gguf --positions ${POSITIONS:-24} > "$O/check-new.txt" 2>/tmp/check-new.log; echo "gpu-check new rc=$?" >> "$L"
wait; date >> "$L"
bench() {  # build file prompt gen tag [env]
  local v=$1 f=$2 n=$3 g=$4 tag=$5; shift 5
  env "$@" timeout 200 /tmp/$v bench-gpu --model $f --prompt $n --gen $g --fracs 1 --modes off --pcie 0 --batch 512 \
    --json "/tmp/b-$tag.json" > /tmp/b-$tag.txt 2>/tmp/b-$tag.log; local rc=$?
  echo "$tag rc=$rc: $(grep -E '^cache|decode after' /tmp/b-$tag.txt | tr -s ' ' | tr '\n' '|' | cut -c1-400)" >> "$L"
  grep -E "panicked|ERROR|error:" /tmp/b-$tag.log | head -2 >> "$L"
}
for r in 1; do
  for f in q4km iq2xs; do
    bench old /tmp/$f.gguf 512 64 $f-old-$r
    bench new /tmp/$f.gguf 512 64 $f-new-$r
    [ $r = 1 ] && bench new /tmp/$f.gguf 512 64 $f-nonarrow-$r STRATA_GPU_NARROW=0
  done
done
date >> "$L"
cat /tmp/b-*.txt > "$O/bench.txt"; for f in /tmp/b-*.json; do echo "$(basename $f) $(cat $f)"; done > "$O/bench.jsonl"
