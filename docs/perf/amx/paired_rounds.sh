# Sourced by paired_trees.sh and paired_step.sh: `paired_rounds ROUNDS A B` runs
# the caller's `one TREE CORE` (which prints one time) for trees A and B at once,
# one a core, the cores swapped every round; prints each round's times and the
# geometric mean of A's time / B's.
paired_rounds() {
  local rounds=$1 a_tree=$2 b_tree=$3 round ca cb a b
  local ratios=()
  for ((round = 1; round <= rounds; round++)); do
    if (( round % 2 )); then ca=0; cb=1; else ca=1; cb=0; fi
    one "$a_tree" $ca > /tmp/paired_a.$$ & one "$b_tree" $cb > /tmp/paired_b.$$ & wait
    a=$(cat /tmp/paired_a.$$); b=$(cat /tmp/paired_b.$$)
    echo "round $round: A $a ms, B $b ms"
    ratios+=("$(python -c "print($a / $b)")")
  done
  rm -f /tmp/paired_a.$$ /tmp/paired_b.$$
  python -c "import math, sys; r = [float(v) for v in sys.argv[1:]]; print(f'A / B: {math.exp(sum(map(math.log, r)) / len(r)):.3f} (rounds {min(r):.3f}-{max(r):.3f})')" "${ratios[@]}"
}
