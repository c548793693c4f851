#!/bin/bash
OUT=/work/main/bench/results/zen4-2026-12-06c/serving
for run in M1 M2; do
  echo "=== $run $(date +%T)"
  (cd /work/main && HF_HUB_OFFLINE=1 timeout 900 python -m bench.bench_grounded --rounds 0 --workloads grounded --per-kind 1 --temperatures 0 --serving-clients 8 --serving-seconds 120 --serving-configs specdec --serving-fresh --out $OUT/$run > $OUT/$run.log 2>&1)
  echo "rc $?"
done
