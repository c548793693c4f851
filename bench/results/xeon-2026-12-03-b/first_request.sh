set -u
mkdir -p /tmp/xeon; mode=$1; prompt=$2; trace=/tmp/xeon/s-$mode.jsonl; rm -f $trace
extra=""; [ "$mode" = nodrafter ] && extra="--drafter none"
specdec up $extra --trace-file $trace --port 50194 > /tmp/xeon/up-$mode.log 2>&1 &
pid=$!
for i in $(seq 1 120); do grep -q "try:" /tmp/xeon/up-$mode.log && break; sleep 2; done
for i in 1; do /usr/bin/time -f "%e s" timeout 120 specdec generate --address 127.0.0.1:50194 --max-new-tokens 64 --temperature 0 "$prompt" 2>&1 >/dev/null | tail -1; done
kill -INT $pid; wait $pid
