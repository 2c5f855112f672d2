#!/usr/bin/env bash
# stop 31 call 1: per-call GPU times of a prompt's chunks (STRATA_GPU_TIMING=ops), then tools/gpu-plan
set -u
O=${OUT:?}; mkdir -p "$O"; L="$O/log.txt"
unxz_to() { python3 -c 'import lzma,shutil,sys; shutil.copyfileobj(lzma.open(sys.argv[1]), open(sys.argv[2],"wb"))' "$1" "$2"; chmod +x "$2"; }
unxz_to .devc/strata-tools.xz /tmp/st
for d in /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib $(python3 -c 'import nvidia,os;print(" ".join(os.path.join(p,"cu13","lib") for p in nvidia.__path__))' 2>/dev/null); do
  [ -d "$d" ] && export LD_LIBRARY_PATH="$d:${LD_LIBRARY_PATH:-}"
done
export STRATA_KERNEL_CACHE=/tmp/strata-kernels; mkdir -p $STRATA_KERNEL_CACHE; tar xJf .devc/kc30.tar.xz -C $STRATA_KERNEL_CACHE
{ nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader; grep -m1 'model name' /proc/cpuinfo; date; } >> "$L"
/tmp/st synth-moe --preset qwen3-30b-a3b --type q4_0 --skew 1.0 --out /tmp/q.gguf 2>&1 | tail -1 >> "$L"; date >> "$L"
for P in 512 4096; do
  echo "== prefill $P, plain" >> "$L"
  timeout 200 /tmp/st bench-gpu --model /tmp/q.gguf --prompt $P --gen 8 --fracs 1 --modes off --pcie 0.33 --batch 512 >> "$L" 2>&1
  echo "== prefill $P, STRATA_GPU_CHUNK_SYNC=1 (every chunk waits, as before)" >> "$L"
  STRATA_GPU_CHUNK_SYNC=1 timeout 200 /tmp/st bench-gpu --model /tmp/q.gguf --prompt $P --gen 8 --fracs 1 --modes off --pcie 0.33 --batch 512 >> "$L" 2>&1
  echo "== prefill $P, STRATA_GPU_TIMING=ops" >> "$L"
  STRATA_LOG=info STRATA_GPU_TIMING=ops timeout 200 /tmp/st bench-gpu --model /tmp/q.gguf --prompt $P --gen 2 --fracs 1 --modes off --pcie 0.33 --batch 512 2>&1 | grep -E "GPU tim|tok/s|prefill|decode" | sed 's/^.*Z *//' | cut -c1-900 >> "$L"
  date >> "$L"
done
OUT=/tmp/gp TOOLS_XZ=.devc/strata-tools.xz DAEMON_XZ=.devc/strata-daemon.xz CTL_XZ=.devc/strata-ctl.xz TMUX_DIR=$PWD/.devc/tmux timeout 420 bash tools/gpu-plan
echo "gpu-plan rc=$?" >> "$L"
cp /tmp/gp/log.txt "$O/plan-log.txt"; cp /tmp/gp/watch-*.txt "$O/" 2>/dev/null
tar cJf "$O/gp.tar.xz" -C /tmp gp; date >> "$L"
