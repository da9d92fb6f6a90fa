#!/bin/bash
# Two source trees' decode steps at the same time, one engine a core (one thread
# each), then the cores swapped, twice: the geometric mean of A's step / B's over
# the four rounds, as paired_trees.sh does for one product.
#   SEQS=16 docs/perf/amx/paired_step.sh TREE_A TREE_B GGUF [STEPS]
set -eu
A=$1; B=$2; G=$3; N=${4:-32}
here=$(cd "$(dirname "$0")" && pwd)
one() { SEQS=${SEQS:-16} THREADS=1 PYTHONPATH=$1 taskset -c "$2" python "$here/step_time.py" "$G" "$N" 2>&1 | tail -1 | awk '{print $1}'; }
source "$here/paired_rounds.sh"
paired_rounds 4 "$A" "$B"
