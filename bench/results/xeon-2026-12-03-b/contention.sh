cd "$(git rev-parse --show-toplevel)"
python bench/results/xeon-2026-12-03-b/contention.py d 1 1 > /tmp/contention-drafter.log 2>/dev/null & dp=$!
until grep -q ready /tmp/contention-drafter.log; do sleep 1; done
sleep 4; echo "drafter alone: $(tail -2 /tmp/contention-drafter.log | tr '\n' ' ')"
for sc in default 3000 10000; do
  envs="X=1"; [ $sc != default ] && envs="GOMP_SPINCOUNT=$sc"
  n0=$(wc -l < /tmp/contention-drafter.log)
  r=$(env $envs python bench/results/xeon-2026-12-03-b/contention.py v 2 0,1 20 2>/dev/null | tail -1)
  echo "beside spin $sc: verifier $r; drafter during: $(tail -n +$((n0+1)) /tmp/contention-drafter.log | tail -4 | tr '\n' ' ')"
done
kill $dp
