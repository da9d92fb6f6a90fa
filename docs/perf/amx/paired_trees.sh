#!/bin/bash
# Two source trees' kernels on one product at the same time, one a core, then the
# cores swapped, three times: the geometric mean of A's time / B's time over the
# six rounds. Running both at once cancels what a shared VM does to one run after
# another (runs minutes apart differed by 10%; A against itself gives 0.99).
#   docs/perf/amx/paired_trees.sh TREE_A TREE_B N K M [TYPE]
# Each tree: a checkout (git worktree add) whose csrc/ the kernels are built from.
set -eu
A=$1; B=$2; shift 2
here=$(cd "$(dirname "$0")" && pwd)
one() { PYTHONPATH=$1 taskset -c "$2" python "$here/product_time.py" "${@:3}" | awk '{print $(NF-1)}'; }
ratios=()
for round in 1 2 3 4 5 6; do
  if (( round % 2 )); then ca=0; cb=1; else ca=1; cb=0; fi
  one "$A" $ca "$@" > /tmp/paired_a.$$ & one "$B" $cb "$@" > /tmp/paired_b.$$ & wait
  a=$(cat /tmp/paired_a.$$); b=$(cat /tmp/paired_b.$$)
  echo "round $round: A $a ms, B $b ms"
  ratios+=("$(python -c "print($a / $b)")")
done
rm -f /tmp/paired_a.$$ /tmp/paired_b.$$
python -c "import math, sys; r = [float(v) for v in sys.argv[1:]]; print(f'A / B: {math.exp(sum(map(math.log, r)) / len(r)):.3f} (rounds {min(r):.3f}-{max(r):.3f})')" "${ratios[@]}"
