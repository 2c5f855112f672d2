#!/usr/bin/env bash
# Stop 62's device call (issue 22): only the placement test on the GPU (`engine_hits_equal_the_replay_on_the_gpu`,
# the CUDA hybrid path handing the store a window's experts in routing order since stop 61), with CUDA graphs and
# without. Carried: .dev/placement-test.xz (the test binary, stripped), .dev/exact4.gguf.xz (the exact fixture's
# first 4 layers, tools/cut-layers), .dev/kc6.tar.xz (its sm_90 kernels, strata-tools build-kernels).
set -u
O=${OUT:?}
xz -dc .dev/placement-test.xz > /tmp/placement-test && chmod +x /tmp/placement-test
mkdir -p /tmp/models && xz -dc .dev/exact4.gguf.xz > /tmp/models/smollm2-moe-exact.gguf
for d in /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib $(python3 -c 'import nvidia,os;print(" ".join(os.path.join(p,"cu13","lib") for p in nvidia.__path__))' 2>/dev/null); do
  [ -d "$d" ] && export LD_LIBRARY_PATH="$d:${LD_LIBRARY_PATH:-}"
done
export STRATA_KERNEL_CACHE=/tmp/strata-kernels
mkdir -p "$STRATA_KERNEL_CACHE" && tar xJf .dev/kc6.tar.xz -C "$STRATA_KERNEL_CACHE"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; nproc; grep -m1 'model name' /proc/cpuinfo
for G in 1 0; do
  echo "== placement test, STRATA_GPU_GRAPHS=$G"
  STRATA_GPU_GRAPHS=$G STRATA_MODEL=/tmp/models/SmolLM2-135M-Instruct.Q4_1.gguf timeout 240 /tmp/placement-test \
    --ignored --nocapture --test-threads 1 > "$O/placement-graphs$G.txt" 2>&1; echo "rc=$?"
  grep -E "^gpu,|greedy tokens|test result|panicked|assert" "$O/placement-graphs$G.txt" | head -20
done
