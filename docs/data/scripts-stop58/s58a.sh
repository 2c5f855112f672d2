#!/usr/bin/env bash
# stop 58 call 1 (issue 18): the stop-57 review build (ea3d964) on the device: gpu-check (kernels, the staging
# sentinel check), the forward pass of tiny-qwen3moe, bench-gpu decode after 32 and 4,096 tokens with every expert
# in VRAM, and Nsight Compute's duration of every kernel of the decode tokens after a 4,096-token prompt (graphs
# off), summed per token by kernel name: where decode time goes at a long context.
set -u
O=${OUT:?}; mkdir -p "$O"; L="$O/log.txt"
. tools/device-env.sh
unxz_to .dev/strata-tools.xz /tmp/cur
( /tmp/cur synth-moe --preset qwen3-30b-a3b --type q4_0 --arch native --out /tmp/q40.gguf 2>&1 | tail -1 >> "$L" ) &
SYN=$!
timeout 200 stdbuf -oL /tmp/cur gpu-check --json "$O/check.json" > "$O/check.txt" 2>/tmp/check.log
echo "gpu-check rc=$? at ${SECONDS}s" >> "$L"; grep -E "panicked|BITS DIFFER|DIFFERS|error|FAIL" "$O/check.txt" /tmp/check.log | head -5 >> "$L"
timeout 100 stdbuf -oL /tmp/cur gpu-check --model .dev/tiny-qwen3moe.gguf --forward-only --positions 80 > /tmp/fwd.txt 2>&1
echo "fwd rc=$? $(grep -i digest /tmp/fwd.txt | head -2 | tr '\n' ' ')" >> "$L"
wait $SYN
for P in 32 4096; do
  timeout 90 /tmp/cur bench-gpu --model /tmp/q40.gguf --prompt $P --gen 64 --warmup --reps 3 --fracs 1 --modes off \
    --pcie 0 --batch 512 > /tmp/b-$P.txt 2>/tmp/b-$P.log
  echo "prompt $P rc=$? at ${SECONDS}s: $(grep -E 'decode after|prefill' /tmp/b-$P.txt | tr -s ' ' | tr '\n' '|' | cut -c1-300)" >> "$L"
  cat /tmp/b-$P.txt >> "$O/bench.txt"
done
for P in 32 4096; do
  STRATA_GPU_GRAPHS=0 timeout 200 ncu --clock-control none --metrics gpu__time_duration.sum --csv --print-units base \
    --launch-count 4000 /tmp/cur bench-gpu --model /tmp/q40.gguf --prompt $P --gen 4 --fracs 1 --modes off --pcie 0 \
    --batch 4096 > /tmp/ncu-$P.csv 2>/tmp/ncu-$P.log; echo "ncu $P rc=$? lines $(wc -l < /tmp/ncu-$P.csv) at ${SECONDS}s" >> "$L"
  python3 - /tmp/ncu-$P.csv > "$O/ncu-decode-$P.txt" <<'PY'
import csv, sys, collections
rows = [r for r in csv.reader(open(sys.argv[1])) if len(r) > 5]
h = rows[0]; ki, vi, gi, bi = h.index("Kernel Name"), h.index("Metric Value"), h.index("Grid Size"), h.index("Block Size")
seq = []
for r in rows[1:]:
    try: v = float(r[vi].replace(",", ""))
    except ValueError: continue
    seq.append((r[ki].split("(")[0], r[gi], r[bi], v))
# decode = the launches after the last prefill-only kernel (tiled attention / grouped experts)
last = max([i for i, s in enumerate(seq) if "tiled" in s[0] or "group_by" in s[0]] + [-1])
dec = seq[last + 1:]
ntok = max(1, sum(1 for s in dec if s[0].startswith("attention")) // 48) if any(s[0].startswith("attention") for s in dec) else 1
comb = sum(1 for s in dec if "combine" in s[0])
print(f"kernels profiled {len(seq)}; decode launches {len(dec)}; tokens ~{ntok} (combine launches {comb})")
tot = collections.OrderedDict()
for s in dec:
    a = tot.setdefault((s[0], s[1], s[2]), [0, 0.0]); a[0] += 1; a[1] += s[3]
print(f"decode total per token {sum(s[3] for s in dec)/ntok/1e3:.1f} us")
for (k, g, b), (n, v) in sorted(tot.items(), key=lambda x: -x[1][1]):
    print(f"{v/ntok/1e3:9.1f} us/token {n/ntok:6.1f}x {v/n/1e3:8.2f} us  {k} grid {g} block {b}")
PY
done
cp /tmp/ncu-4096.log "$O/ncu-log.txt" 2>/dev/null
date >> "$L"; cat "$L"
