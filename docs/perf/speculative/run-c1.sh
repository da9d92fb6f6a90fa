#!/bin/bash
set -u
V=/tmp/venv1
OUT=${OUT:-/tmp/specbench-c1b}
mkdir -p $OUT
cd /work/main
$V/bin/stoker serve --host 127.0.0.1 --port 8210 > $OUT/stoker-auto.log 2>&1 &
P1=$!
$V/bin/stoker serve --host 127.0.0.1 --port 8212 --speculative-method none > $OUT/stoker-none.log 2>&1 &
P2=$!
trap "kill $P1 $P2 2>/dev/null" EXIT
for port in 8210 8212; do until curl -sf localhost:$port/ready >/dev/null; do sleep 1; done; done
$V/bin/stoker bench serve --url http://127.0.0.1:8210 --compare http://127.0.0.1:8212 --endpoint chat --temperature 0 --no-progress --workload grounded --concurrency 1 --num-requests 8 --input-len 400 --output-len 128 --repeats 3 --out $OUT/grounded-c1 2>&1 | tail -3
