#!/bin/bash
# Prefill and decode through the offline LLM (docs/perf/k-quants/prefill_decode.py),
# the tree before the 256-bit exact kernels (BEFORE) and this tree in turn, on each
# quantized-matmul path given (STOKER_QUANT_ISA forces it): run.sh BEFORE GGUF ISA... (ROUNDS=2)
set -eu
before=$1 gguf=$2
shift 2
here=$(cd "$(dirname "$0")/../../../.." && pwd)
cd /tmp  # `python -m`/scripts put the current folder first on sys.path
echo "# $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2-), $(nproc) cores; $(basename "$gguf")"
for round in $(seq "${ROUNDS:-2}"); do
    for isa in "$@"; do
        for tree in "$before" "$here"; do
            label=$([ "$tree" = "$here" ] && echo after || echo before)
            echo "round $round $isa $label: $(STOKER_QUANT_ISA=$isa PYTHONPATH=$tree python "$here/docs/perf/k-quants/prefill_decode.py" "$gguf" 2>/dev/null | tail -1)"
        done
    done
done
