#!/bin/bash
# Alternated: N = a worktree of cb2374e (/work/before), M = the working tree (runs a decoders' cut lets in whole skip the turn).
OUT=/work/main/bench/results/zen4-2026-12-06c/serving
for run in N4 M3 N5 M4; do
  case $run in N*) dir=/work/before;; M*) dir=/work/main;; esac
  echo "=== $run $(date +%T) in $dir"
  (cd $dir && HF_HUB_OFFLINE=1 timeout 900 python -m bench.bench_grounded --rounds 0 --workloads grounded --per-kind 1 --temperatures 0 --serving-clients 8 --serving-seconds 120 --serving-configs specdec --serving-fresh --out $OUT/$run > $OUT/$run.log 2>&1)
  echo "rc $?"
done
