#!/bin/bash
# A Zen 3's view on an AVX-512 machine: this tree (8200) and BEFORE (8202) forced onto
# the avx2 quantized-matmul path, against llama-server built for AVX2 alone (8201,
# LLAMA_AVX2_BIN: cmake -DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON
# -DGGML_AVX512=OFF -DGGML_AVX_VNNI=OFF), default model, alternating in one run: the
# servers and workload of docs/perf/prefetch/run.sh.
# Usage: served.sh BEFORE   (OUT defaults to /tmp/bavx2)
# The rest of each program (torch's own kernels, stoker's attention) still runs with
# AVX-512 where it finds it: this isolates the quantized matmuls, it is not a Zen 3.
HERE=$(cd "$(dirname "$0")/../../../.." && pwd)
STOKER_QUANT_ISA=avx2 LLAMA_SERVER=${LLAMA_AVX2_BIN:-/tmp/llamacpp-avx2/bin/llama-server} OUT=${OUT:-/tmp/bavx2} \
    exec bash "$HERE/docs/perf/prefetch/run.sh" "$@"
