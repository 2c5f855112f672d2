#!/usr/bin/env bash
# stop 52 call 1: where a prefill chunk's GPU time goes, kernel by kernel (issue 18). Q4_0 qwen3moe file of the
# Qwen3-30B-A3B geometry, every expert in VRAM: per-call GPU times at 4,096 (STRATA_GPU_TIMING=ops) with the norms
# as clusters (default) and as one block per row (STRATA_GPU_NORM_CLUSTER=0), then Nsight Compute's duration of
# every kernel of a 1,024-token prefill (two chunks of 512), summed by kernel name.
set -u
O=${OUT:?}; mkdir -p "$O"; L="$O/log.txt"
. tools/device-env.sh
unxz_to .dev/strata-tools-cur.xz /tmp/cur
/tmp/cur synth-moe --preset qwen3-30b-a3b --type q4_0 --skew 1.0 --arch native --out /tmp/q40.gguf 2>&1 | tail -1 >> "$L"
bench() {  # file prompt gen tag [env]
  local f=$1 n=$2 g=$3 tag=$4; shift 4
  env "$@" timeout 100 /tmp/cur bench-gpu --model $f --prompt $n --gen $g --fracs 1 --modes off --pcie 0 --batch 512 \
    --json "/tmp/b-$tag.json" > /tmp/b-$tag.txt 2>/tmp/b-$tag.log; local rc=$?
  echo "$tag rc=$rc: $(grep -E '^cache|decode after' /tmp/b-$tag.txt | tr -s ' ' | tr '\n' '|' | cut -c1-400)" >> "$L"
  grep -E "panicked|ERROR|error:" /tmp/b-$tag.log | head -2 >> "$L"
}
bench /tmp/q40.gguf 4096 32 q40-4096-1
bench /tmp/q40.gguf 4096 4 ops-cluster STRATA_GPU_TIMING=ops
bench /tmp/q40.gguf 4096 4 ops-block STRATA_GPU_TIMING=ops STRATA_GPU_NORM_CLUSTER=0
for t in cluster block; do grep -h "GPU time by call" /tmp/b-ops-$t.log | cut -c1-400 > "$O/ops-$t.txt"; done
cat /tmp/b-*.txt > "$O/bench.txt"
date >> "$L"
timeout 300 ncu --clock-control none --metrics gpu__time_duration.sum --csv --print-units base --launch-count 6000 \
  /tmp/cur bench-gpu --model /tmp/q40.gguf --prompt 1024 --gen 1 --fracs 1 --modes off --pcie 0 --batch 512 \
  > /tmp/ncu.csv 2>/tmp/ncu.log; echo "ncu rc=$? lines $(wc -l < /tmp/ncu.csv) $(date +%T)" >> "$L"
tail -3 /tmp/ncu.log >> "$L"
python3 - /tmp/ncu.csv > "$O/ncu-sum.txt" <<'PY'
import csv, sys, collections
rows = [r for r in csv.reader(open(sys.argv[1])) if len(r) > 5]
h = rows[0]; ki, vi, gi, bi = h.index("Kernel Name"), h.index("Metric Value"), h.index("Grid Size"), h.index("Block Size")
tot = collections.OrderedDict(); seq = []
for r in rows[1:]:
    try: v = float(r[vi].replace(",", ""))
    except ValueError: continue
    k = r[ki].split("(")[0]; seq.append((k, r[gi], r[bi], v))
    a = tot.setdefault(k, [0, 0.0]); a[0] += 1; a[1] += v
print("kernels profiled:", len(seq), "total ms:", sum(s[3] for s in seq) / 1e6)
for k, (n, v) in sorted(tot.items(), key=lambda x: -x[1][1]):
    print(f"{v/1e6:10.3f} ms {n:6d}x {v/n/1e3:9.2f} us  {k}")
print("\n# one layer of the second chunk (launch order): kernel grid block us")
big = [i for i, s in enumerate(seq) if "expert" in s[0] and "mmq" in s[0]]
if len(big) > 60:
    i0 = big[-30]; j = i0 + 1
    while j < len(seq) and not ("expert" in seq[j][0] and "mmq" in seq[j][0]): j += 1
    for s in seq[max(0, i0 - 1): j + 1]: print(f"{s[0]:40s} {s[1]:>16s} {s[2]:>12s} {s[3]/1e3:9.2f}")
PY
cp /tmp/ncu.log "$O/ncu-log.txt" 2>/dev/null; xz -c /tmp/ncu.csv > "$O/ncu.csv.xz"
date >> "$L"
