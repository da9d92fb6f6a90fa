#!/bin/bash
# launch to first 200 on /ready, alternating trees: startup_ab.sh TREE_A TREE_B ROUNDS
A=$1; B=$2; N=${3:-4}  # EXTRA: more `stoker serve` flags, e.g. EXTRA=--no-embedding-model
# Runs from /tmp: `python -m` puts the current folder first on sys.path.
cd /tmp
one() { t0=$(date +%s.%N); PYTHONPATH=$1 STOKER_CACHE_DIR=/tmp/stoker-cache /tmp/venv1/bin/python -m stoker.cli serve --port 8300 --db /tmp/su.db $EXTRA > /tmp/su.log 2>&1 & P=$!; until [ "$(curl -s -o /dev/null -w '%{http_code}' http://127.0.0.1:8300/ready)" = 200 ]; do sleep 0.05; done; printf "%.2f" "$(echo "$(date +%s.%N) - $t0" | bc)"; kill $P; wait $P 2>/dev/null; sleep 1; }
for i in $(seq $N); do echo "round $i: $(one $A) s ($A) | $(one $B) s ($B)"; done
