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
product=("$@")
one() { PYTHONPATH=$1 taskset -c "$2" python "$here/product_time.py" "${product[@]}" | awk '{print $(NF-1)}'; }
source "$here/paired_rounds.sh"
paired_rounds 6 "$A" "$B"
