#!/usr/bin/env bash
# Stop 61's device call (issue 22): the placement test on the GPU after lrfu's lead test and the rank order of a
# window's experts (the CUDA hybrid path now hands the store a window's experts in routing order), with and
# without CUDA graphs, then bench-gpu's half-cache arms (static, blocking, async; prefetch off) on the synthetic
# Qwen3-30B-A3B geometry. Carried: .dev/strata-tools.xz, .dev/placement-test.xz, .dev/exact4.gguf.xz (the exact
# fixture's first 4 layers, tools/cut-layers), .dev/kc6.tar.xz (kernel cache for it, strata-tools build-kernels).
set -u
O=${OUT:?}/placement
TEST_T=240 BENCH_T=120 PREFETCH="0" MODES=off,blocking,async KERNELS=.dev/kc6.tar.xz \
  bash tools/gpu-placement .dev/strata-tools.xz .dev/placement-test.xz .dev/exact4.gguf.xz "$O" 2>&1 | tee "$OUT/run.txt"
