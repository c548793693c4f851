#!/bin/bash
# Run order A1 N1 N2 A2 N3 A3; A = a worktree of 0371ccc (/work/before), N = the working tree with the pending run in its turn (committed next).
# alternate A (before, 0371ccc) and N (working tree) 8-client runs
set -u
OUT=/work/main/bench/results/zen4-2026-12-06c/serving
mkdir -p $OUT
for run in A1 N1 N2 A2 N3 A3; do
  case $run in A*) dir=/work/before;; N*) dir=/work/main;; esac
  echo "=== $run $(date +%T) in $dir"
  (cd $dir && HF_HUB_OFFLINE=1 timeout 900 python -m bench.bench_grounded --rounds 0 --workloads grounded --per-kind 1 --temperatures 0 --serving-clients 8 --serving-seconds 120 --serving-configs specdec --serving-fresh --out $OUT/$run > $OUT/$run.log 2>&1)
  echo "rc $?"
done
