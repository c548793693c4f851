set -u
mode=$1; trace=/tmp/xeon/served-$mode.jsonl; rm -f $trace
extra=""; [ "$mode" = nodrafter ] && extra="--drafter none"
specdec up $extra --trace-file $trace --port 50194 > /tmp/xeon/up-$mode.log 2>&1 &
pid=$!
for i in $(seq 1 120); do grep -q "try:" /tmp/xeon/up-$mode.log && break; sleep 2; done
for i in 1 2 3; do timeout 120 specdec generate --address 127.0.0.1:50194 --method autoregressive --max-new-tokens 48 --temperature 0 "Write a short story about a lighthouse keeper who" > /dev/null 2>&1; done
kill -INT $pid; wait $pid
python bench/results/xeon-2026-12-02/served_passes.py $trace
