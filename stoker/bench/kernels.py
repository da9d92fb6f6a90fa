"""Times the quantized matmul (stoker.models.quant.kernels.ggml_matmul) against
torch on the dequantized weight: F.linear in fp32, and the oneDNN-packed fp32
linear stoker/models/layers.py uses. Shapes are the default model's
(SmolLM2-135M: Q4_1 projections, Q8_0 LM head) plus K-quants at 2048 x 2048.

    python -m stoker.bench.kernels [--m 1 32 512] [--seconds 0.3] [--markdown]

Prints ms per call (median of repeats) and effective weight GB/s: the bytes of
the weight as that path reads it (GGUF blocks for ggml, fp32 for torch) / time.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType, quants

from stoker.models.cpu_kernels import cpu_flags
from stoker.models.quant.blocks import random_blocks
from stoker.models.quant.kernels import ggml_matmul, quant_isa

T = GGMLQuantizationType
# (name, n, k, type)
SHAPES: tuple[tuple[str, int, int, GGMLQuantizationType], ...] = (
    ("q/o", 576, 576, T.Q4_1),
    ("k/v", 192, 576, T.Q4_1),
    ("gate/up", 1536, 576, T.Q4_1),
    ("down", 576, 1536, T.Q4_1),
    ("lm_head", 49152, 576, T.Q8_0),
    ("2k", 2048, 2048, T.Q4_K),
    ("2k", 2048, 2048, T.Q5_K),
    ("2k", 2048, 2048, T.Q6_K),
)


def time_call(fn: Callable[[], object], seconds: float) -> float:
    """Median seconds per call over repeats filling about `seconds` (at least 3)."""
    fn()  # warm up: builds, page faults, oneDNN primitive creation
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < 3 or (time.perf_counter() - start < seconds and len(times) < 200):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "unknown")
    except OSError:
        return platform.processor() or "unknown"


def measure(ms: list[int], seconds: float) -> list[dict[str, object]]:
    rows: list[dict[str, object]] = []
    for name, n, k, qtype in SHAPES:
        blocks = random_blocks(qtype, n, k, seed=0)
        w_q = torch.from_numpy(blocks)
        w_f32 = torch.from_numpy(quants.dequantize(blocks, qtype).astype(np.float32))
        mkldnn = torch.backends.mkldnn.is_available()  # type: ignore[no-untyped-call]  # torch leaves it unannotated
        packed = torch.ops.mkldnn._reorder_linear_weight(w_f32, None) if mkldnn else None
        for m in ms:
            x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
            t_q = time_call(lambda x=x, w_q=w_q, qtype=qtype: ggml_matmul(x, w_q, qtype), seconds)  # type: ignore[misc]
            t_lin = time_call(lambda x=x, w_f32=w_f32: F.linear(x, w_f32), seconds)  # type: ignore[misc]
            t_pk = (
                time_call(
                    lambda x=x, packed=packed: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], ""),  # type: ignore[misc]
                    seconds,
                )
                if packed is not None
                else float("nan")
            )
            rows.append(
                {
                    "tensor": name,
                    "type": qtype.name,
                    "n x k": f"{n}x{k}",
                    "m": m,
                    "ggml ms": t_q * 1e3,
                    "ggml GB/s": blocks.nbytes / t_q / 1e9,
                    "F.linear ms": t_lin * 1e3,
                    "F.linear GB/s": w_f32.numel() * 4 / t_lin / 1e9,
                    "packed ms": t_pk * 1e3,
                    "packed GB/s": w_f32.numel() * 4 / t_pk / 1e9,
                    "vs best torch": min(t_lin, t_pk) / t_q,
                }
            )
            print(_line(rows[-1]), flush=True)
    return rows


def _fmt(v: object) -> str:
    if isinstance(v, float):
        return f"{v:.3f}" if v < 10 else f"{v:.1f}"
    return str(v)


def _line(row: dict[str, object]) -> str:
    return " | ".join(f"{_fmt(v):>8}" for v in row.values())


def markdown(rows: list[dict[str, object]]) -> str:
    head = list(rows[0])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(_fmt(v) for v in row.values()) + " |" for row in rows]
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--m", type=int, nargs="+", default=[1, 32, 512], help="rows of x (tokens)")
    parser.add_argument("--seconds", type=float, default=0.3, help="time budget per measurement")
    parser.add_argument("--threads", type=int, default=None, help="torch (and kernel) threads; default torch's")
    parser.add_argument("--markdown", action="store_true", help="also print the table as markdown")


def run(args: argparse.Namespace) -> int:
    """`stoker bench kernels`: the quantized matmul against torch on the default model's shapes."""
    if args.threads:
        torch.set_num_threads(args.threads)
    flags = " ".join(
        f for f in ("avx2", "fma", "f16c", "avx512f", "avx512_vnni", "avx_vnni", "amx_int8") if f in cpu_flags()
    )
    print(f"CPU: {cpu_model()} ({flags}); torch threads: {torch.get_num_threads()}; path: {quant_isa()}")
    print(
        " | ".join(
            ["tensor", "type", "n x k", "m", "ggml ms", "GB/s", "F.linear ms", "GB/s", "packed ms", "GB/s", "speedup"]
        )
    )
    rows = measure(args.m, args.seconds)
    if args.markdown:
        print()
        print(markdown(rows))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
