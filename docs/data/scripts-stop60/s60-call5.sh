#!/usr/bin/env bash
# stop 60, call 5 (run inline on the machine call 4 left warm, as one command line; kept here as it ran): llama.cpp
# built on the host, llama-bench's decode after 4,096 tokens with and without -ncmoe 24, then strata's bench-gpu on
# the same file (all in VRAM and half off VRAM, static), nothing else running. Needs call 4's /tmp/q40.gguf and
# /tmp/cur (s60a.sh PART=E).
export OUT; L=$OUT/log.txt; . tools/device-env.sh; LB=/tmp/lc/llama.cpp/build/bin/llama-bench; build_llama_bench; for a in "-fa 1" "-fa 1 -ncmoe 24"; do timeout 40 $LB -m /tmp/q40.gguf -t 16 -ngl 99 -p 0 -n 32 -d 4096 $a -o md >> $OUT/lb.md 2>/dev/null; echo "lb $a rc=$? at $SECONDS" >> $L; done; timeout 60 /tmp/cur bench-gpu --model /tmp/q40.gguf --prompt 4096 --gen 32 --warmup --reps 1 --fracs 1,0.5 --modes off --pcie 0 --batch 512 > $OUT/bench.txt 2>/dev/null; echo "strata rc=$? at $SECONDS" >> $L; cat $L; grep '^|' $OUT/lb.md; grep -E "^cache|decode after" $OUT/bench.txt
