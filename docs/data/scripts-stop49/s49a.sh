#!/usr/bin/env bash
# stop 49 call 1: the tensor-core products skip their padding column tiles. gpu-check (old and new build: equal
# digests), then bench-gpu prefill 512 / 4,096 on the synthetic Qwen3-30B-A3B geometry (Q4_0, llama arch, every
# expert in VRAM) alternating the builds, then the Q4_K_M qwen3moe file (prefill 512, decode 64) with per-call
# GPU times (STRATA_GPU_TIMING=ops).
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
# the synthetic files while gpu-check runs
( /tmp/new synth-moe --preset qwen3-30b-a3b --type q4_0 --skew 1.0 --out /tmp/q40.gguf 2>&1 | tail -1 >> "$L"
  /tmp/new synth-moe --preset qwen3-30b-a3b --type q4_k_m --skew 1.0 --arch native --out /tmp/q4km.gguf 2>&1 | tail -1 >> "$L" ) &
for v in old new; do
  timeout 200 /tmp/$v gpu-check --model /tmp/fx.gguf --positions ${POSITIONS:-64} > "$O/check-$v.txt" 2>/tmp/check-$v.log; echo "gpu-check $v rc=$?" >> "$L"
done
for c in $(grep -o 'digest [0-9a-f]*' "$O/check-old.txt" | cut -d' ' -f2); do
  grep -q "$c" "$O/check-new.txt" && echo "same $c" || echo "DIFFERS $c"
done | sort | uniq -c >> "$L"
grep -iE "mmq|tensor" "$O/check-new.txt" | head -12 >> "$L"
wait; date >> "$L"
bench() {  # build file prompt gen tag [env]
  local v=$1 f=$2 n=$3 g=$4 tag=$5; shift 5
  env "$@" timeout 200 /tmp/$v bench-gpu --model $f --prompt $n --gen $g --fracs 1 --modes off --pcie 0 --batch 512 \
    --json "/tmp/b-$tag.json" > /tmp/b-$tag.txt 2>/tmp/b-$tag.log; local rc=$?
  echo "$tag rc=$rc: $(grep -E '^cache|decode after' /tmp/b-$tag.txt | tr -s ' ' | tr '\n' '|' | cut -c1-400)" >> "$L"
  grep -E "panicked|ERROR|error:" /tmp/b-$tag.log | head -2 >> "$L"
}
for r in 1 2; do
  for v in old new; do bench $v /tmp/q40.gguf 512 32 q40-512-$v-$r; done
  for v in old new; do bench $v /tmp/q40.gguf 4096 32 q40-4096-$v-$r; done
done
date >> "$L"
for v in old new; do bench $v /tmp/q4km.gguf 512 64 q4km-512-$v; done
bench new /tmp/q4km.gguf 512 16 q4km-ops STRATA_GPU_TIMING=ops
bench new /tmp/q40.gguf 4096 8 q40-ops STRATA_GPU_TIMING=ops
grep -h "GPU time by call" /tmp/b-q4km-ops.log /tmp/b-q40-ops.log | cut -c1-700 > "$O/ops.txt"
grep -h "GPU timing: 1 tokens" /tmp/b-q4km-ops.log | tail -5 >> "$O/ops.txt"
cat /tmp/b-*.txt > "$O/bench.txt"; for f in /tmp/b-*.json; do echo "$(basename $f) $(cat $f)"; done > "$O/bench.jsonl"
date >> "$L"
# per-kernel GPU time of Q4_K_M decode (after an 8-token prompt; launches past the prompt pass)
timeout 130 ncu --clock-control none --metrics gpu__time_duration.sum --csv --print-units base --launch-skip 700 \
  --launch-count 450 /tmp/new bench-gpu --model /tmp/q4km.gguf --prompt 8 --gen 24 --fracs 1 --modes off --pcie 0 \
  --batch 512 > /tmp/ncu.csv 2>/tmp/ncu.log; echo "ncu rc=$?" >> "$L"
python3 - /tmp/ncu.csv <<'PY' > "$O/ncu-decode-q4km.txt" 2>&1
import csv, sys, collections
rows = [r for r in csv.reader(open(sys.argv[1])) if len(r) > 10]
h = rows[0]; ki = h.index("Kernel Name"); vi = h.index("Metric Value")
t = collections.defaultdict(float); n = collections.Counter()
for r in rows[1:]:
    try: v = float(r[vi].replace(",", ""))
    except ValueError: continue
    k = r[ki].split("(")[0]; t[k] += v; n[k] += 1
tot = sum(t.values())
print(f"total {tot/1e6:.3f} ms over {sum(n.values())} launches")
for k, v in sorted(t.items(), key=lambda kv: -kv[1]):
    print(f"{k:<40} {n[k]:>6} {v/1e6:>10.3f} ms {100*v/tot:>6.1f}% {v/n[k]/1e3:>9.2f} us/launch")
PY
date >> "$L"
