#!/bin/bash
# Alternating runs: the tree before the Q4_K/Q5_K exact kernels (BEFORE), this
# tree, and llama.cpp's llama-bench on the same file. Usage: run.sh BEFORE GGUF LLAMA_BENCH
set -eu
before=$1 gguf=$2 llama_bench=$3
here=$(cd "$(dirname "$0")/../../.." && pwd)
for round in 1 2; do
    echo "round $round"
    echo "  before: $(PYTHONPATH=$before python "$here/docs/perf/k-quants/prefill_decode.py" "$gguf" 2>/dev/null | tail -1)"
    echo "  after:  $(PYTHONPATH=$here python "$here/docs/perf/k-quants/prefill_decode.py" "$gguf" 2>/dev/null | tail -1)"
    "$llama_bench" -m "$gguf" -t 2 -p 512 -n 64 -r 2 2>/dev/null | grep -E "pp512|tg64" | sed 's/^/  llama-bench: /'
done
