# Whole passes of the default target, three trees alternated per round, 3 rounds (from the repo root):
#   before: a worktree of c0a2c51 (git worktree add /tmp/wt-before c0a2c51), with its cached grid
#   quant:  this tree with SPECDEC_LAYER_KERNELS=0 (fused quantisation, the paired grid)
#   now:    this tree
#   bash bench/results/zen4-2026-12-06f/pass_ab.sh /tmp/wt-before > pass-ab.txt   (9 min)
before=${1:?a worktree of c0a2c51}
for i in 1 2 3; do
  (cd "$before" && PYTHONPATH="$before" python -m bench.bench_pass --json --widths 1,4,10,16 2>/dev/null | sed 's/^/before /')
  SPECDEC_LAYER_KERNELS=0 PYTHONPATH=. python -m bench.bench_pass --json --widths 1,4,10,16 2>/dev/null | sed 's/^/quant  /'
  PYTHONPATH=. python -m bench.bench_pass --json --widths 1,4,10,16 2>/dev/null | sed 's/^/now    /'
done
