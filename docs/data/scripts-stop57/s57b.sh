#!/usr/bin/env bash
# stop 57 call 2 (issue 18): where a prefill chunk's time goes with half the experts off VRAM (static, 512-token
# chunks): bench-gpu with the H2D rate from the RAM copy itself (registered), then the same under Nsight Systems
# (one warm-up and one timed 512-token prompt): the copies' and kernels' GPU time summed, and their overlap.
set -u
O=${OUT:?}; mkdir -p "$O"; L="$O/log.txt"
. tools/device-env.sh
unxz_to .dev/strata-tools.xz /tmp/cur
/tmp/cur synth-moe --preset qwen3-30b-a3b --type q4_0 --arch native --out /tmp/q40.gguf 2>&1 | tail -1 >> "$L"
NSYS=$(command -v nsys || ls /usr/local/cuda*/bin/nsys /opt/nvidia/nsight-systems*/bin/nsys /usr/local/cuda*/nsight-systems*/bin/nsys 2>/dev/null | head -1)
echo "nsys: ${NSYS:-none}" >> "$L"
timeout 100 /tmp/cur bench-gpu --model /tmp/q40.gguf --prompt 512 --gen 8 --warmup --reps 3 --fracs 0.5 --modes off \
  --pcie 0 --batch 512 > "$O/bench.txt" 2>/tmp/b.log
echo "bench rc=$? at ${SECONDS}s: $(grep -h 'prompt runs' /tmp/b.log | head -1)" >> "$L"; grep -E "H2D" "$O/bench.txt" >> "$L"
if [ -n "$NSYS" ]; then
  timeout 200 $NSYS profile -o /tmp/p --force-overwrite true --trace cuda --sample none --cpuctxsw none \
    /tmp/cur bench-gpu --model /tmp/q40.gguf --prompt 512 --gen 2 --warmup --reps 1 --fracs 0.5 --modes off --pcie 0 \
    --batch 512 > /tmp/n.txt 2>/tmp/n.log
  echo "nsys rc=$? at ${SECONDS}s" >> "$L"; tail -3 /tmp/n.log >> "$L"
  $NSYS stats --report cuda_gpu_trace --format csv --output /tmp/tr /tmp/p.nsys-rep > /dev/null 2>&1
  ls /tmp/tr* >> "$L"
  python3 - "$O" /tmp/tr_cuda_gpu_trace.csv >> "$L" 2>&1 <<'PY'
import csv, sys, lzma
out, path = sys.argv[1], sys.argv[2]
rows = list(csv.DictReader(open(path)))
print("trace rows", len(rows), "columns", list(rows[0].keys())[:12])
# the last 512-token chunk: the last 48 x (copies) ... take the span of the last 'ev' before decode: use the time
# window of the last 0.4 s before the first decode kernel is hard to name; take everything, and per 10 ms bins
def f(r, k):
    try: return float(r[k])
    except: return 0.0
ev = []
for r in rows:
    st = f(r, 'Start (ns)'); du = f(r, 'Duration (ns)'); name = r.get('Name', '')
    kind = 'copyH2D' if ('HtoD' in name or 'Host-to-Device' in name) else ('copyD2H' if ('DtoH' in name or 'Device-to-Host' in name) else ('copy' if 'memcpy' in name.lower() or 'memset' in name.lower() else 'kernel'))
    ev.append((st, st + du, kind, name, f(r, 'Bytes (MB)') if 'Bytes (MB)' in r else 0))
ev.sort()
t0, t1 = ev[0][0], max(e[1] for e in ev)
print("span %.1f ms" % ((t1 - t0) / 1e6))
# big H2D copies (> 1 MB): the expert uploads; group into bursts separated by > 50 ms of no big copy
big = [e for e in ev if e[2] == 'copyH2D' and e[4] > 1.0]
print("big H2D copies", len(big), "MB", round(sum(e[4] for e in big)), "busy ms", round(sum(e[1]-e[0] for e in big)/1e6, 1))
bursts = []
for e in big:
    if bursts and e[0] - bursts[-1][1] < 50e6:
        bursts[-1][1] = max(bursts[-1][1], e[1]); bursts[-1][2].append(e)
    else:
        bursts.append([e[0], e[1], [e]])
for b in bursts:
    s, t, es = b
    mb = sum(e[4] for e in es); busy = sum(e[1]-e[0] for e in es)
    ks = [e for e in ev if e[2] == 'kernel' and e[0] >= s and e[1] <= t]
    kb = sum(e[1]-e[0] for e in ks)
    # union of copy and kernel busy time in the burst
    iv = sorted([(e[0], e[1]) for e in ev if e[0] >= s and e[1] <= t])
    un = 0; cs = ce = None
    for a, z in iv:
        if ce is None or a > ce:
            if ce is not None: un += ce - cs
            cs, ce = a, z
        else: ce = max(ce, z)
    if ce is not None: un += ce - cs
    print("burst %.1f ms: %d copies %.0f MB, copy busy %.1f ms (%.1f GB/s while copying), kernels %d busy %.1f ms, any busy %.1f ms, idle %.1f ms" % (
        (t-s)/1e6, len(es), mb, busy/1e6, mb/1e3/(busy/1e9), len(ks), kb/1e6, un/1e6, ((t-s)-un)/1e6))
    # the top kernels by time in the last burst
last = bursts[-1]
ks = {}
for e in ev:
    if e[2] == 'kernel' and e[0] >= last[0] and e[1] <= last[1]:
        k = e[3].split('(')[0][:40]; ks[k] = ks.get(k, 0) + e[1]-e[0]
for k, v in sorted(ks.items(), key=lambda x: -x[1])[:12]:
    print("  %-40s %.2f ms" % (k, v/1e6))
# gaps on the GPU in the last burst longer than 20 us, summed, and the 5 longest with what preceded them
iv = sorted([e for e in ev if e[0] >= last[0] and e[1] <= last[1]])
gaps = []; end = iv[0][1]; prev = iv[0]
for e in iv[1:]:
    if e[0] - end > 20e3: gaps.append((e[0]-end, prev[3][:30], e[3][:30]))
    if e[1] > end: end = e[1]; prev = e
print("gaps > 20 us: %d, %.1f ms" % (len(gaps), sum(g[0] for g in gaps)/1e6))
for g in sorted(gaps, reverse=True)[:5]: print("  gap %.0f us after %s before %s" % (g[0]/1e3, g[1], g[2]))
PY
  xz -c /tmp/tr_cuda_gpu_trace.csv > "$O/trace.csv.xz"
fi
date >> "$L"; cat "$L"
