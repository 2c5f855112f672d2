#!/usr/bin/env bash
# stop 31 call 6: the final build on the GPU: greedy and temperature decode, the async tier, exit status
set -u
O=${OUT:?}; mkdir -p "$O"; L="$O/log.txt"
unxz_to() { python3 -c 'import lzma,shutil,sys; shutil.copyfileobj(lzma.open(sys.argv[1]), open(sys.argv[2],"wb"))' "$1" "$2"; chmod +x "$2"; }
unxz_to .devc/strata-tools.xz /tmp/st; unxz_to .devc/strata-daemon.xz /tmp/sd; unxz_to .devc/strata-ctl.xz /tmp/sc
for d in /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib $(python3 -c 'import nvidia,os;print(" ".join(os.path.join(p,"cu13","lib") for p in nvidia.__path__))' 2>/dev/null); do
  [ -d "$d" ] && export LD_LIBRARY_PATH="$d:${LD_LIBRARY_PATH:-}"
done
export STRATA_KERNEL_CACHE=/tmp/strata-kernels; mkdir -p $STRATA_KERNEL_CACHE; tar xJf .devc/kc30.tar.xz -C $STRATA_KERNEL_CACHE
/tmp/st synth-moe --preset qwen3-30b-a3b --type q4_0 --skew 1.0 --arch native --out /tmp/q.gguf 2>&1 | tail -1 >> "$L"; date >> "$L"
for ARM in "plain" "async --vram-reserve-mib 126000 --adapt-async 1"; do
  set -- $ARM; lab=$1; shift
  rm -f /tmp/s.sock
  STRATA_LOG=info timeout 150 /tmp/sd --model /tmp/q.gguf --socket /tmp/s.sock "$@" > "$O/d-$lab.log" 2>&1 &
  pid=$!
  for i in $(seq 1 120); do grep -qE "listening|strata-daemon: " "$O/d-$lab.log" && break; sleep 1; done
  for T in 0 0.7 1.0; do
    echo -n "$lab temperature $T: " >> "$L"
    /tmp/sc --socket /tmp/s.sock generate --max-tokens 256 --temperature $T --seed 5 "Tell me about the sea, in detail, for a long while please." 2>&1 >/dev/null | grep -oE "prompt [0-9]+ tokens?|generated [0-9]* tokens in [0-9.]* ms \([0-9.]* tok/s\)|[0-9]+ swaps" | tr '\n' ' ' >> "$L"; echo >> "$L"
  done
  kill -TERM $pid; wait $pid; echo "$lab exit status $?" >> "$L"
  grep -iE "warn|error|panick" "$O/d-$lab.log" | head -5 >> "$L"
done
date >> "$L"
