#!/usr/bin/env bash
# stop 31 call 3: the daemon's exit with the context released last (and a SIGSEGV backtrace if it still crashes)
set -u
O=${OUT:?}; mkdir -p "$O"; L="$O/log.txt"
unxz_to() { python3 -c 'import lzma,shutil,sys; shutil.copyfileobj(lzma.open(sys.argv[1]), open(sys.argv[2],"wb"))' "$1" "$2"; chmod +x "$2"; }
unxz_to .devc/strata-tools.xz /tmp/st; unxz_to .devc/strata-daemon.xz /tmp/sd; unxz_to .devc/strata-ctl.xz /tmp/sc
for d in /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib $(python3 -c 'import nvidia,os;print(" ".join(os.path.join(p,"cu13","lib") for p in nvidia.__path__))' 2>/dev/null); do
  [ -d "$d" ] && export LD_LIBRARY_PATH="$d:${LD_LIBRARY_PATH:-}"
done
export STRATA_KERNEL_CACHE=/tmp/strata-kernels; mkdir -p $STRATA_KERNEL_CACHE; tar xJf .devc/kc30.tar.xz -C $STRATA_KERNEL_CACHE
/tmp/st synth-moe --preset qwen3-30b-a3b --type q4_0 --skew 1.0 --out /tmp/q.gguf 2>&1 | tail -1 >> "$L"; date >> "$L"
stop_test() { # label gen(0/1) flags...
  local lab=$1 gen=$2; shift 2
  rm -f /tmp/s.sock
  STRATA_LOG=info timeout 120 /tmp/sd --model /tmp/q.gguf --socket /tmp/s.sock "$@" > "$O/x-$lab.log" 2>&1 &
  local pid=$!
  for i in $(seq 1 100); do grep -qE "listening|strata-daemon: " "$O/x-$lab.log" && break; sleep 1; done
  [ "$gen" = 1 ] && /tmp/sc --socket /tmp/s.sock generate --max-tokens 40 "Tell me about the sea, at length and in detail, please." > /dev/null 2>> "$L"
  kill -TERM $pid; wait $pid; echo "== exit $lab ($*): rc=$?" >> "$L"; grep -A40 "SIGSEGV" "$O/x-$lab.log" | head -60 >> "$L"; tail -2 "$O/x-$lab.log" | cut -c1-200 >> "$L"
}
stop_test plain 0
stop_test gen 1
stop_test reserve-gen 1 --vram-reserve-mib 126000
stop_test async-gen 1 --vram-reserve-mib 126000 --adapt-async 1
date >> "$L"
