#!/usr/bin/env bash
# stop 31 call 4: decode at temperature 0.7 (the sampler) against greedy, this build and 8f43203's, on the GPU daemon;
# a clean exit of this build
set -u
O=${OUT:?}; mkdir -p "$O"; L="$O/log.txt"
unxz_to() { python3 -c 'import lzma,shutil,sys; shutil.copyfileobj(lzma.open(sys.argv[1]), open(sys.argv[2],"wb"))' "$1" "$2"; chmod +x "$2"; }
unxz_to .devc/strata-tools.xz /tmp/st; unxz_to .devc/strata-daemon.xz /tmp/sd; unxz_to .devc/strata-ctl.xz /tmp/sc
for d in /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib $(python3 -c 'import nvidia,os;print(" ".join(os.path.join(p,"cu13","lib") for p in nvidia.__path__))' 2>/dev/null); do
  [ -d "$d" ] && export LD_LIBRARY_PATH="$d:${LD_LIBRARY_PATH:-}"
done
export STRATA_KERNEL_CACHE=/tmp/strata-kernels; mkdir -p $STRATA_KERNEL_CACHE; tar xJf .devc/kc30.tar.xz -C $STRATA_KERNEL_CACHE
{ nvidia-smi --query-gpu=name --format=csv,noheader; grep -m1 'model name' /proc/cpuinfo; } >> "$L"
/tmp/st synth-moe --preset qwen3-30b-a3b --type q4_0 --skew 1.0 --arch native --out /tmp/q.gguf 2>&1 | tail -1 >> "$L"; date >> "$L"
for B in sd; do
  rm -f /tmp/s.sock
  STRATA_LOG=info timeout 150 /tmp/$B --model /tmp/q.gguf --socket /tmp/s.sock > "$O/d-$B.log" 2>&1 &
  pid=$!
  for i in $(seq 1 120); do grep -qE "listening|strata-daemon: " "$O/d-$B.log" && break; sleep 1; done
  for T in 0 0.7 0 0.7; do
    echo -n "$B temperature $T: " >> "$L"
    /tmp/sc --socket /tmp/s.sock generate --max-tokens 256 --temperature $T --seed 5 "Tell me about the sea." 2>&1 >/dev/null | grep -o "generated [0-9]* tokens in [0-9.]* ms ([0-9.]* tok/s)" >> "$L" || echo "(no line)" >> "$L"
  done
  kill -TERM $pid; wait $pid; echo "$B exit status $?" >> "$L"
done
grep -m1 "vocab\|n_vocab" "$O/d-sd.log" | cut -c1-200 >> "$L"
date >> "$L"
