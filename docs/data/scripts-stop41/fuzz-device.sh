#!/usr/bin/env bash
# device: libFuzzer campaign on the host's cores. args: TARGETS... ; env RUNS_PER_JOB, JOBS, SECS
set -u
cd "$(dirname "$0")"
tar xJf fuzzbin.tar.xz
J=${JOBS:-16}
echo "CPU: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ //'), $(nproc) cores" | tee -a $OUT/report.txt
for T in "$@"; do
  case $T in gguf) LEN=65536;; *) LEN=16384;; esac
  mkdir -p corpus/$T art/$T logs
  ( cd logs && STRATA_MODELS=$PWD/../tokmodel ../bin/$T ../corpus/$T -runs=${RUNS_PER_JOB:-700000} -max_total_time=${SECS:-270} \
    -max_len=$LEN -timeout=1 -rss_limit_mb=1024 -malloc_limit_mb=1024 -print_final_stats=1 -jobs=$J -workers=$J \
    -artifact_prefix=../art/$T/ > ../logs/$T-main.log 2>&1 )
  RC=$?
  EXECS=$(cat logs/fuzz-*.log 2>/dev/null | grep -E '^stat::number_of_executed_units' | awk '{s+=$2} END {print s+0}')
  TIME=$(cat logs/fuzz-*.log | grep -E '^Done [0-9]+ runs in' | sed -E 's/.* in ([0-9]+) second.*/\1/' | sort -n | tail -1)
  COV=$(cat logs/fuzz-*.log | grep -oE 'cov: [0-9]+' | awk '{print $2}' | sort -n | tail -1)
  SLOW=$(cat logs/fuzz-*.log | grep -c 'ERROR: libFuzzer: timeout\|out-of-memory\|deadly signal' )
  FOUND=$(find art/$T -type f | wc -l)
  echo "$T: $EXECS executions over $J workers in ${TIME:-?} s (longest worker), cov $COV edges, exit $RC, findings $FOUND, error reports $SLOW" | tee -a $OUT/report.txt
  tail -n 30 logs/fuzz-0.log > $OUT/$T-worker0.txt
  mkdir -p $OUT/art-$T; cp art/$T/* $OUT/art-$T/ 2>/dev/null
  rm -f logs/fuzz-*.log
done
