#!/bin/bash
# Two source trees' decode steps at the same time, one engine a core (one thread
# each), then the cores swapped, twice: the geometric mean of A's step / B's over
# the four rounds, as paired_trees.sh does for one product.
#   SEQS=16 docs/perf/amx/paired_step.sh TREE_A TREE_B GGUF [STEPS]
set -eu
A=$1; B=$2; G=$3; N=${4:-32}
here=$(cd "$(dirname "$0")" && pwd)
one() { SEQS=${SEQS:-16} THREADS=1 PYTHONPATH=$1 taskset -c "$2" python "$here/step_time.py" "$G" "$N" 2>&1 | tail -1 | awk '{print $1}'; }
ratios=()
for round in 1 2 3 4; do
  if (( round % 2 )); then ca=0; cb=1; else ca=1; cb=0; fi
  one "$A" $ca > /tmp/paired_a.$$ & one "$B" $cb > /tmp/paired_b.$$ & wait
  a=$(cat /tmp/paired_a.$$); b=$(cat /tmp/paired_b.$$)
  echo "round $round: A $a ms, B $b ms"
  ratios+=("$(python -c "print($a / $b)")")
done
rm -f /tmp/paired_a.$$ /tmp/paired_b.$$
python -c "import math, sys; r = [float(v) for v in sys.argv[1:]]; print(f'A / B: {math.exp(sum(map(math.log, r)) / len(r)):.3f} (rounds {min(r):.3f}-{max(r):.3f})')" "${ratios[@]}"
