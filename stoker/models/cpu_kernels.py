"""CPU kernels in C, compiled on first use with the system compiler and loaded
with ctypes: no torch headers, so a build takes about a second. Callers fall
back to the pure-torch path when no compiler is available."""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import re
import shutil
import subprocess
import tempfile
from functools import cache
from pathlib import Path

import torch

from stoker.models.kv_quant import BF16_QUERY_CACHES, KV_FORMATS

log = logging.getLogger("stoker.kernels")

_CSRC = Path(__file__).parent / "csrc"
# Reassociation lets reductions vectorize. Not -ffast-math: a shared library
# linked with it sets flush-to-zero for the whole process when loaded.
_FLAGS = [
    "-O3",
    "-march=native",
    "-fno-math-errno",
    "-fno-trapping-math",
    "-fno-signed-zeros",
    "-fassociative-math",
    "-freciprocal-math",
    "-fPIC",
    "-shared",
    "-fopenmp",
]


def _cache_dir() -> Path:
    root = os.environ.get("STOKER_CACHE_DIR") or os.path.join(Path.home(), ".cache", "stoker")
    return Path(root) / "kernels"


@cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags from /proc/cpuinfo (empty where there is none)."""
    try:
        with open("/proc/cpuinfo") as f:
            line = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        line = ""
    return frozenset(line.partition(":")[2].split())


def _cpu_signature() -> str:
    # -march=native binds the library to this CPU's instruction set.
    return platform.machine() + " ".join(sorted(cpu_flags()))


def compiled(name: str, flags: tuple[str, ...] | None = None, variant: str = "") -> Path | None:
    """The cached library of csrc/{name}.c for these flags and this CPU (keyed by
    source, flags and CPU), compiled now if it is not there yet; None without a
    compiler or when the build fails. `flags` replaces the default flags (and
    -march=native) where given; `variant` names the build, so several builds of one
    source can be loaded side by side. Safe to call from several threads at once."""
    compiler = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    path = _CSRC / f"{name}.c"
    # The headers and included sources count too: a changed one must not load a library built without it.
    source = path.read_bytes() + b"".join(h.read_bytes() for h in sorted(_CSRC.glob("*.h")))
    for included in re.findall(rb'#include "(\w+\.c)"', path.read_bytes()):
        source += (_CSRC / included.decode()).read_bytes()
    cflags = list(_FLAGS if flags is None else flags)
    key = hashlib.sha256(source + " ".join(cflags).encode() + _cpu_signature().encode()).hexdigest()[:16]
    target = _cache_dir() / f"{name}{'-' + variant if variant else ''}-{key}.so"
    if not target.exists():
        if compiler is None:
            log.warning("no C compiler found: %s runs on the slower pure-torch path", name)
            return None
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            built = Path(tmp) / target.name
            result = subprocess.run(
                [compiler, *cflags, str(path), "-o", str(built), "-lm"], capture_output=True, text=True
            )
            if result.returncode != 0:
                log.warning("building the C kernel %s failed, using pure torch:\n%s", name, result.stderr[-2000:])
                return None
            os.replace(built, target)  # atomic, so concurrent builders never see half a file
    return target


@cache
def _build(name: str, flags: tuple[str, ...] | None = None, variant: str = "") -> ctypes.CDLL | None:
    """csrc/{name}.c compiled for this CPU (see compiled) and loaded."""
    if os.environ.get("STOKER_DISABLE_C_KERNELS") == "1":
        return None
    target = compiled(name, flags, variant)
    return None if target is None else ctypes.CDLL(str(target))


@cache
def _paged_attention_library(isa: str) -> ctypes.CDLL | None:
    """paged_attention.c built for the ISA path `isa`, as the quantized matmuls and the
    fused decoder are (one attention, attention.h, whichever path calls it)."""
    from stoker.models.quant import kernels  # imports this module: not at the top

    lib = kernels.build_for_isa("paged_attention", isa)
    if lib is None:
        return None
    i, f, p = ctypes.c_int, ctypes.c_float, ctypes.c_void_p
    lib.paged_decode_attention.restype = i
    lib.paged_decode_attention.argtypes = [p] * 6 + [i] * 6 + [f] + [i] * 3
    lib.paged_prefill_attention.restype = i
    lib.paged_prefill_attention.argtypes = [p] * 5 + [i] * 6 + [f] + [i] * 3
    lib.paged_attention_supported.restype = i
    lib.paged_attention_supported.argtypes = [i]
    return lib


def load_paged_attention() -> ctypes.CDLL | None:
    """The paged-attention kernels for the ISA path in use (STOKER_QUANT_ISA, re-read on
    every call and logged once per path by quant_isa); None without a compiler."""
    if os.environ.get("STOKER_DISABLE_C_KERNELS") == "1":
        return None
    try:
        from stoker.models.quant import kernels
    except ImportError as exc:
        log.warning("paged attention kernels unavailable (%s)", exc)
        return None
    return _paged_attention_library(kernels.quant_isa())


def paged_attention_isa() -> str:
    """The ISA path load_paged_attention builds for now (what the attention backend logs)."""
    from stoker.models.quant import kernels

    return str(kernels.quant_isa())


@cache
def load_fused_ops() -> ctypes.CDLL | None:
    lib = _build("fused_ops")
    if lib is None:
        return None
    i, f, p = ctypes.c_int, ctypes.c_float, ctypes.c_void_p
    lib.rms_norm.argtypes = [p, p, p, i, i, f, i, i]
    lib.silu_mul.argtypes = [p, p, i, i, i, i]
    lib.rotary.argtypes = [p, p, p, p, p, i, i, i, i, i, i]
    for fn in (lib.rms_norm, lib.silu_mul, lib.rotary):
        fn.restype = None
    return lib


def paged_attention_supported(head_dim: int) -> bool:
    """Whether the C attention kernels are here and serve this head size (a multiple of 8, at most 512)."""
    lib = load_paged_attention()
    return lib is not None and bool(lib.paged_attention_supported(head_dim))


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """q [seqs, heads, head_dim] -> out of the same shape (written into `out`
    when given, which must be contiguous); None if the kernel cannot serve this
    call (no compiler, unsupported dtype or device). The caches may hold
    quantized rows (models/kv_quant.py) whatever q's dtype."""
    lib = load_paged_attention()
    kv_type = _kv_type(q, k_cache, v_cache)
    if lib is None or kv_type is None:
        return None
    q = q.contiguous()
    if out is None:
        out = torch.empty_like(q)
    elif not out.is_contiguous() or out.shape != q.shape or out.dtype != q.dtype:
        raise ValueError("out must be a contiguous tensor shaped and typed like q")
    seqs, heads, head_dim = q.shape
    _, block_size, kv_heads, _ = k_cache.shape
    failed = lib.paged_decode_attention(
        q.data_ptr(),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        block_tables.data_ptr(),
        context_lens.data_ptr(),
        out.data_ptr(),
        seqs,
        heads,
        kv_heads,
        head_dim,
        block_size,
        block_tables.shape[1],
        scale,
        int(q.dtype == torch.bfloat16),
        kv_type,
        torch.get_num_threads(),
    )
    if failed == 1:
        raise MemoryError("the C attention kernel could not allocate its scratch memory")
    return None if failed else out


def paged_prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_ids: torch.Tensor,
    context_len: int,
    scale: float,
    out: torch.Tensor,
) -> bool:
    """Causal attention of one sequence's chunk q [n, heads, head_dim] (its last
    n positions of context_len) over the paged cache, written into `out` (same
    shape, contiguous). False if the kernel cannot serve this call. Each row
    computes exactly what paged_decode_attention does for a sequence ending there."""
    lib = load_paged_attention()
    kv_type = _kv_type(q, k_cache, v_cache)
    if lib is None or kv_type is None or block_ids.dtype != torch.int64:
        return False
    if not (q.is_contiguous() and out.is_contiguous() and block_ids.is_contiguous()):
        raise ValueError("q, out and block_ids must be contiguous")
    n, heads, head_dim = q.shape
    _, block_size, kv_heads, _ = k_cache.shape
    if block_ids.numel() * block_size < context_len:
        raise ValueError("block_ids do not cover context_len")
    rc = lib.paged_prefill_attention(
        q.data_ptr(),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        block_ids.data_ptr(),
        out.data_ptr(),
        n,
        context_len,
        heads,
        kv_heads,
        head_dim,
        block_size,
        scale,
        int(q.dtype == torch.bfloat16),
        kv_type,
        torch.get_num_threads(),
    )
    if rc == 1:
        raise MemoryError("the C prefill kernel could not allocate its scratch memory")
    return bool(rc == 0)


def _kv_type(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> int | None:
    """The C code of the caches' dtype if the attention kernels can serve q over them:
    fp32 q over any cache they read, bf16 q over bf16 or quantized rows, all
    contiguous on the CPU."""
    if not _cpu_float(q) or k_cache.dtype != v_cache.dtype or not (k_cache.is_cpu and v_cache.is_cpu):
        return None
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        return None
    code = KV_FORMATS.get(k_cache.dtype)
    if code is None or (q.dtype == torch.bfloat16 and k_cache.dtype not in BF16_QUERY_CACHES):
        return None
    return code


def _cpu_float(*tensors: torch.Tensor) -> bool:
    """All on the CPU in one dtype, fp32 or bf16: what every C kernel here takes.
    Called several times per layer, so plain loops and is_cpu, not generators and devices."""
    dtype = tensors[0].dtype
    if dtype is not torch.float32 and dtype is not torch.bfloat16:
        return False
    return all(not (not t.is_cpu or t.dtype is not dtype) for t in tensors)


def _fused(*tensors: torch.Tensor) -> ctypes.CDLL | None:
    """The fused-ops library if it can serve these tensors."""
    return load_fused_ops() if _cpu_float(*tensors) else None


def fused_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
    """LlamaRMSNorm over the last dim in one pass; None if the C op cannot serve x."""
    lib = _fused(x, weight)
    if lib is None or not x.is_contiguous() or not weight.is_contiguous() or x.numel() == 0:
        return None
    out = torch.empty_like(x)
    dim = x.shape[-1]
    lib.rms_norm(
        x.data_ptr(),
        weight.data_ptr(),
        out.data_ptr(),
        x.numel() // dim,
        dim,
        eps,
        int(x.dtype == torch.bfloat16),
        torch.get_num_threads(),
    )
    return out


def fused_silu_mul(gate_up: torch.Tensor) -> torch.Tensor | None:
    """[rows, 2I] (gate, up) -> silu(gate) * up [rows, I]; None if the C op cannot serve it."""
    lib = _fused(gate_up)
    if lib is None or gate_up.dim() != 2 or not gate_up.is_contiguous() or gate_up.shape[1] % 2:
        return None
    rows, inter = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(rows, inter, dtype=gate_up.dtype)
    if rows:
        lib.silu_mul(
            gate_up.data_ptr(),
            out.data_ptr(),
            rows,
            inter,
            int(gate_up.dtype == torch.bfloat16),
            torch.get_num_threads(),
        )
    return out


def fused_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor) -> torch.Tensor | None:
    """x [tokens, heads, head_dim], rows may be strided (a slice of qkv) -> a new
    contiguous tensor with rotary applied from the [positions, head_dim] tables;
    None if the C op cannot serve it."""
    lib = _fused(x, cos, sin)
    tokens, heads, head_dim = x.shape
    if lib is None or head_dim > 512 or head_dim % 2 or positions.dtype != torch.int64:
        return None
    if x.stride(2) != 1 or x.stride(1) != head_dim or not (cos.is_contiguous() and sin.is_contiguous()):
        return None
    out = torch.empty(tokens, heads, head_dim, dtype=x.dtype)
    if tokens:
        positions = positions.contiguous()
        lib.rotary(
            x.data_ptr(),
            out.data_ptr(),
            cos.data_ptr(),
            sin.data_ptr(),
            positions.data_ptr(),
            tokens,
            heads,
            head_dim,
            x.stride(0),
            int(x.dtype == torch.bfloat16),
            torch.get_num_threads(),
        )
    return out
