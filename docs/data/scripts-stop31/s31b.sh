#!/usr/bin/env bash
# stop 31 call 2: the daemon's exit (segfault after "stopped"?) for this build and 8f43203's; the tiled prefill
# attention with cp.async stages: gpu-check kernels (+ compute-sanitizer on attention_tiled), bench-gpu prefill
set -u
O=${OUT:?}; mkdir -p "$O"; L="$O/log.txt"
unxz_to() { python3 -c 'import lzma,shutil,sys; shutil.copyfileobj(lzma.open(sys.argv[1]), open(sys.argv[2],"wb"))' "$1" "$2"; chmod +x "$2"; }
unxz_to .devc/strata-tools.xz /tmp/st; unxz_to .devc/strata-daemon.xz /tmp/sd; unxz_to .devc/strata-daemon-8f43203.xz /tmp/sdold
for d in /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib $(python3 -c 'import nvidia,os;print(" ".join(os.path.join(p,"cu13","lib") for p in nvidia.__path__))' 2>/dev/null); do
  [ -d "$d" ] && export LD_LIBRARY_PATH="$d:${LD_LIBRARY_PATH:-}"
done
export PATH=$PATH:/usr/local/cuda/bin
export STRATA_KERNEL_CACHE=/tmp/strata-kernels; mkdir -p $STRATA_KERNEL_CACHE; tar xJf .devc/kc31.tar.xz -C $STRATA_KERNEL_CACHE; tar xJf .devc/kc30.tar.xz -C $STRATA_KERNEL_CACHE
{ nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader; grep -m1 'model name' /proc/cpuinfo; date; ls $STRATA_KERNEL_CACHE; command -v gdb compute-sanitizer; } >> "$L" 2>&1
/tmp/st synth-moe --preset qwen3-30b-a3b --type q4_0 --skew 1.0 --out /tmp/q.gguf 2>&1 | tail -1 >> "$L"; date >> "$L"
stop_test() { # label binary flags...
  local lab=$1 bin=$2; shift 2
  rm -f /tmp/s.sock
  STRATA_LOG=info timeout 120 $bin --model /tmp/q.gguf --socket /tmp/s.sock "$@" > "$O/x-$lab.log" 2>&1 &
  local pid=$!
  for i in $(seq 1 100); do grep -qE "listening|strata-daemon: " "$O/x-$lab.log" && break; sleep 1; done
  kill -TERM $pid; wait $pid; echo "== exit $lab ($*): rc=$?" >> "$L"; tail -2 "$O/x-$lab.log" | cut -c1-200 >> "$L"
}
stop_test cur /tmp/sd
stop_test old /tmp/sdold
stop_test cur-gpuoff /tmp/sd --gpu off
stop_test cur-plan /tmp/sd --vram-reserve-mib 126000
if command -v gdb >/dev/null; then
  rm -f /tmp/s.sock
  STRATA_LOG=info timeout 150 gdb -q -batch -ex "handle SIGTERM nostop noprint pass" -ex "handle SIGPIPE nostop noprint pass" -ex run -ex bt -ex "thread apply all bt 12" --args /tmp/sd --model /tmp/q.gguf --socket /tmp/s.sock > "$O/gdb.txt" 2>&1 &
  for i in $(seq 1 100); do grep -qE "listening" "$O/gdb.txt" && break; sleep 1; done
  pkill -TERM -x sd; wait; echo "== gdb done" >> "$L"
fi
date >> "$L"
echo "== gpu-check kernels" >> "$L"
timeout 240 /tmp/st gpu-check --json "$O/check.json" > "$O/check.txt" 2>"$O/check.err"; echo "rc=$?" >> "$L"
grep -iE "attention|tiled|fail|panick" "$O/check.txt" | head -40 >> "$L"; date >> "$L"
echo "== compute-sanitizer, attention_tiled" >> "$L"
timeout 200 compute-sanitizer --tool memcheck --print-limit 10 --kernel-name regex:attention_tiled /tmp/st gpu-check > "$O/san.txt" 2>&1; echo "rc=$?" >> "$L"
grep -E "ERROR SUMMARY|Invalid|racecheck" "$O/san.txt" | head -5 >> "$L"; date >> "$L"
for P in 512 4096 16384; do
  echo "== prefill $P" >> "$L"
  G=8; [ $P -gt 8192 ] && G=4
  timeout 200 /tmp/st bench-gpu --model /tmp/q.gguf --prompt $P --gen $G --fracs 1 --modes off --pcie 0.33 --batch 512 2>&1 | grep -vE "H2D|INFO|loaded" >> "$L"
  date >> "$L"
done
echo "== prefill 4096, STRATA_GPU_TIMING=ops" >> "$L"
STRATA_LOG=info STRATA_GPU_TIMING=ops timeout 200 /tmp/st bench-gpu --model /tmp/q.gguf --prompt 4096 --gen 2 --fracs 1 --modes off --pcie 0.33 --batch 512 2>&1 | grep -E "GPU time by|cache 100" | sed 's/^.*Z *//' | cut -c1-600 >> "$L"
date >> "$L"
