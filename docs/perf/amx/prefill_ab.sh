#!/bin/bash
# Time to first token of one prompt at a time, the avx512_amx path (port 8201) against
# avx512_vnni (port 8202): two `stoker serve` on one GGUF, the bench alternating them.
#   docs/perf/amx/prefill_ab.sh ~/.cache/stoker/ladder/llama-3.2-1b-q4_k_m.gguf
# (the ladder writes that file: stoker bench ladder --models llama-3.2-1b-q4_k_m ...)
set -eu
GGUF=$1
work=$(mktemp -d)
trap 'kill $(jobs -p) 2>/dev/null; rm -rf "$work"' EXIT
for pair in "8201 avx512_amx" "8202 avx512_vnni"; do
  set -- $pair
  STOKER_DB=$work/$1.db STOKER_QUANT_ISA=$2 stoker serve --model "$GGUF" --host 127.0.0.1 --port "$1" \
    --no-embedding-model --max-num-seqs 16 --max-model-len 4096 --kv-cache-tokens 16384 --num-threads 2 \
    --speculative-method none --no-enable-prefix-caching > "$work/$1.log" 2>&1 &
done
for port in 8201 8202; do
  until curl -sf "localhost:$port/ready" > /dev/null; do sleep 0.5; done
done
for len in 512 2048; do
  stoker bench serve --url http://127.0.0.1:8201 --compare http://127.0.0.1:8202 --tokenizer "$GGUF" \
    --concurrency 1 --num-requests 4 --repeats 3 --warmup 1 --seed 7 --input-len "$len" --output-len 1 \
    --ignore-eos --temperature 0
done
