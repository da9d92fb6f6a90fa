"""Quantized matmul over GGUF weight blocks: y = x @ W^T with W kept in its ggml
block layout (Q4_0 ... Q6_K) and x quantized to int8 per row on the fly, as
llama.cpp's CPU backend does. The C source (csrc/ggml_quant.c) is built once per
ISA level with explicit -m flags, so a lower path really runs the lower code;
the best one this CPU can run is used unless STOKER_QUANT_ISA names another.

Output (i, j) is bit-identical whatever m, the tiling and the thread count
(see the C file), so batching never changes a sequence's result. On the SIMD
paths every type (avx2: but Q8_0) takes the "exact" kernels (a blocked GEMM
from 4 rows with AVX-512, from 8 on the 256-bit paths, small tiles below, one
arithmetic for both; docs/quantization.md#the-kernels). Where the CPU has
AMX-INT8 and Linux grants the tile state, the avx512_amx path runs the K-quants'
GEMM from 64 rows on the tiles (csrc/amx_tiles.h), to the same bits."""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
import platform
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import cache

import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from stoker.models.cpu_kernels import _build, compiled, cpu_flags

log = logging.getLogger("stoker.kernels")

SUPPORTED_TYPES: frozenset[GGMLQuantizationType] = frozenset(
    {
        GGMLQuantizationType.Q4_0,
        GGMLQuantizationType.Q4_1,
        GGMLQuantizationType.Q5_0,
        GGMLQuantizationType.Q5_1,
        GGMLQuantizationType.Q8_0,
        GGMLQuantizationType.Q4_K,
        GGMLQuantizationType.Q5_K,
        GGMLQuantizationType.Q6_K,
    }
)

# Not -march=native and not -fassociative-math: the build must be the named ISA
# level and nothing more, and float operations must stay in source order (batch
# invariance). -ffp-contract=off keeps the compiler from fusing a*b+c on its own.
_BASE_FLAGS = ("-O3", "-fno-math-errno", "-fno-trapping-math", "-ffp-contract=off", "-fPIC", "-shared", "-fopenmp")
_AVX2 = ("-mavx2", "-mfma", "-mf16c")


@dataclass(frozen=True)
class _Isa:
    name: str
    cpu_needs: frozenset[str]  # /proc/cpuinfo flags
    cflags: tuple[str, ...]
    code: int  # what ggml_quant_isa() in the built library reports


_AVX512_NEEDS = frozenset({"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni"})
_AVX512 = ("-march=x86-64", *_AVX2, "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni")

# Best first.
_X86_ISAS = (
    # avx512_vnni with the K-quants' GEMM on AMX-INT8 tiles from 64 rows of x (csrc/amx_tiles.h).
    _Isa("avx512_amx", _AVX512_NEEDS | {"amx_tile", "amx_int8"}, (*_AVX512, "-mamx-tile", "-mamx-int8"), 4),
    _Isa("avx512_vnni", _AVX512_NEEDS, _AVX512, 3),
    _Isa("avx_vnni", frozenset({"avx2", "fma", "f16c", "avx_vnni"}), ("-march=x86-64", *_AVX2, "-mavxvnni"), 2),
    _Isa("avx2", frozenset({"avx2", "fma", "f16c"}), ("-march=x86-64", *_AVX2), 1),
    _Isa("portable", frozenset(), ("-march=x86-64",), 0),
)
_GENERIC_ISAS = (_Isa("portable", frozenset(), (), 0),)


def _isas() -> tuple[_Isa, ...]:
    return _X86_ISAS if platform.machine() in ("x86_64", "AMD64") else _GENERIC_ISAS


def _amx_permitted() -> bool:
    """Whether Linux lets this process use the AMX tile registers: they are
    handed out only on request (arch_prctl ARCH_REQ_XCOMP_PERM for XTILEDATA, for
    the whole process), which a kernel before 5.16 or a VM may refuse."""
    sys_arch_prctl, arch_req_xcomp_perm, xfeature_xtiledata = 158, 0x1023, 18
    libc = ctypes.CDLL(None, use_errno=True)
    return bool(libc.syscall(sys_arch_prctl, arch_req_xcomp_perm, xfeature_xtiledata) == 0)


@cache
def _available() -> tuple[str, ...]:
    flags = cpu_flags()
    names = tuple(isa.name for isa in _isas() if isa.cpu_needs <= flags)
    if "avx512_amx" in names and not _amx_permitted():
        log.info("quantized matmul: the CPU has AMX but the kernel refused the tile state; not using it")
        names = tuple(name for name in names if name != "avx512_amx")
    return names


def available_isas() -> list[str]:
    """The paths this CPU can run, best first (the last is always "portable")."""
    return list(_available())


_logged: set[str] = set()


def quant_isa() -> str:
    """The path in use: STOKER_QUANT_ISA if set (ValueError if this CPU cannot run
    it), else the best available. The variable is re-read on every call, so tests
    can switch it; what it resolves to is worked out once per value (this runs
    before every matmul)."""
    chosen = _resolve(os.environ.get("STOKER_QUANT_ISA", "").strip())
    if chosen not in _logged:
        _logged.add(chosen)
        log.info("quantized matmul: %s path", chosen)
    return chosen


@cache
def _resolve(forced: str) -> str:
    available = _available()
    if forced and forced not in available:
        known = [isa.name for isa in _X86_ISAS]
        why = "unknown" if forced not in known else "not supported by this CPU"
        raise ValueError(f"STOKER_QUANT_ISA={forced!r} is {why}; available here: {', '.join(available)}")
    return forced or available[0]


# The sources built once per ISA path (each includes ggml_quant.c, so a change to it rebuilds all three).
ISA_SOURCES = ("ggml_quant", "decoder_layer", "paged_attention")


def _isa_build(source: str, isa: _Isa) -> tuple[str, tuple[str, ...], str]:
    """The (source, flags, variant) that name source's build for one ISA path in the cache."""
    return source, _BASE_FLAGS + isa.cflags, isa.name


def prebuild_every_isa(workers: int) -> None:
    """Every ISA_SOURCES build for every path this CPU can run, compiled into the
    cache `workers` at a time. What loads them later finds them built; a run that
    loads them all (the test suite forces each path) otherwise compiles them one
    after another, ~67 s on 2 cores of a Zen 4 when ggml_quant.c changed."""
    jobs = [_isa_build(source, isa) for source in ISA_SOURCES for isa in _isas() if isa.name in _available()]
    with ThreadPoolExecutor(max_workers=workers) as pool:
        list(pool.map(lambda job: compiled(*job), jobs))


def build_for_isa(source: str, name: str) -> ctypes.CDLL | None:
    """csrc/{source}.c (ggml_quant.c or a file that includes it) built for the ISA
    path `name` with this module's flags; None where it cannot be built."""
    isa = next(isa for isa in _isas() if isa.name == name)
    lib = _build(*_isa_build(source, isa))
    if lib is None:
        return None
    if lib.ggml_quant_isa() != isa.code:
        raise RuntimeError(f"the {name} build of {source}.c compiled as path {lib.ggml_quant_isa()}, not {isa.code}")
    return lib


def declare_signatures(lib: ctypes.CDLL) -> ctypes.CDLL:
    """lib (a build of ggml_quant.c, this module's or one loaded from elsewhere, as the
    benchmarks in docs/perf do to set builds side by side) with its entry points' C
    signatures declared; returns lib."""
    i, p = ctypes.c_int, ctypes.c_void_p
    lib.ggml_quant_matmul.restype = i
    lib.ggml_quant_matmul.argtypes = [i, p, i, i, i, p, i, p, ctypes.c_long, i]
    lib.ggml_quant_exact_kernels.restype = i
    lib.ggml_quant_exact_kernels.argtypes = [i]
    lib.ggml_quant_dequantize_rows.restype = i
    lib.ggml_quant_dequantize_rows.argtypes = [i, p, i, p, i, p, i, i]
    if not hasattr(lib, "ggml_quant_pack"):  # a build from before the packed weights (benchmarks' baselines)
        return lib
    lib.ggml_quant_matmul_packed.restype = i
    lib.ggml_quant_matmul_packed.argtypes = [i, p, i, i, i, p, i, p, ctypes.c_long, i]
    lib.ggml_quant_packed_serves.restype = i
    lib.ggml_quant_packed_serves.argtypes = [i]
    lib.ggml_quant_packed_bytes.restype = ctypes.c_size_t
    lib.ggml_quant_packed_bytes.argtypes = [i, i, i]
    lib.ggml_quant_pack.restype = i
    lib.ggml_quant_pack.argtypes = [i, p, i, i, p, i, i]
    return lib


@cache
def _library(name: str) -> ctypes.CDLL | None:
    lib = build_for_isa("ggml_quant", name)
    return None if lib is None else declare_signatures(lib)


def _lib() -> ctypes.CDLL | None:
    if os.environ.get("STOKER_DISABLE_C_KERNELS") == "1":
        return None
    return _library(quant_isa())


def _row_elems(weight: torch.Tensor, qtype: GGMLQuantizationType) -> int:
    """k, the logical row length of a [n, row_bytes] uint8 block tensor (ValueError if malformed)."""
    if weight.dtype != torch.uint8 or weight.dim() != 2:
        raise ValueError(
            f"weight must be a 2-D uint8 tensor of {qtype.name} blocks, got {weight.dtype} {tuple(weight.shape)}"
        )
    if not weight.is_contiguous():
        raise ValueError("weight rows must be contiguous")
    block_elems, type_size = GGML_QUANT_SIZES[qtype]
    if weight.shape[1] % type_size:
        raise ValueError(f"a {qtype.name} row is whole {type_size}-byte blocks; got {weight.shape[1]} bytes")
    return weight.shape[1] // type_size * block_elems


def exact_kernels(qtype: GGMLQuantizationType) -> bool:
    """Whether the path in use serves this type with the exact kernels (a blocked
    GEMM from 4 or 8 rows, small tiles below; the SIMD builds, every
    type but avx2's Q8_0): a different fp32 summation than the tile kernels, the same whatever m."""
    lib = _lib()
    return lib is not None and qtype in SUPPORTED_TYPES and bool(lib.ggml_quant_exact_kernels(int(qtype)))


def ggml_matmul(
    x: torch.Tensor, weight: torch.Tensor, qtype: GGMLQuantizationType, out: torch.Tensor | None = None
) -> torch.Tensor | None:
    """y = x @ W^T, [m, n] in x's dtype (written into `out` when given: [m, n],
    stride(1) == 1, e.g. a column slice of a wider tensor). None when the kernel
    cannot serve the call (no compiler, kernels disabled, unsupported type,
    dtype or device) so the caller falls back; ValueError for malformed input."""
    if qtype not in SUPPORTED_TYPES or not weight.is_cpu or not _served(x):
        return None
    k = _row_elems(weight, qtype)
    return _matmul(x, weight, qtype, k, weight.shape[0], out, packed=False)


def _served(x: torch.Tensor) -> bool:
    """Whether a matmul of this x can run here at all (else the caller falls back)."""
    return x.is_cpu and x.dtype in (torch.float32, torch.bfloat16) and _lib() is not None


def packs(qtype: GGMLQuantizationType) -> bool:
    """Whether the path in use multiplies `qtype` from weights repacked into its
    GEMM's panel order (ggml_pack; csrc/packed_panels.h): Q4_K, Q6_K, Q8_0, Q5_0 and Q4_0 on
    the SIMD paths (but AVX2's Q8_0, which stays on the tile kernels)."""
    lib = _lib()
    return lib is not None and qtype in SUPPORTED_TYPES and bool(lib.ggml_quant_packed_serves(int(qtype)))


def ggml_pack(weight: torch.Tensor, qtype: GGMLQuantizationType, num_threads: int | None = None) -> torch.Tensor | None:
    """W's blocks repacked into panel order (a new uint8 tensor, 1-D), or None where
    this type or shape is not packed. Every build packs the same layout; only the
    SIMD builds multiply it (ggml_matmul_packed). num_threads: torch's when None."""
    lib = _library(_any_isa())
    if lib is None or qtype not in SUPPORTED_TYPES:
        return None
    k = _row_elems(weight, qtype)
    size = int(lib.ggml_quant_packed_bytes(int(qtype), weight.shape[0], k))
    if size == 0:
        return None
    packed = huge_page_bytes(size)
    lib.ggml_quant_pack(
        int(qtype), weight.data_ptr(), weight.shape[0], k, packed.data_ptr(), 0, num_threads or torch.get_num_threads()
    )
    return packed


def huge_page_bytes(size: int) -> torch.Tensor:
    """A uint8 tensor of `size` bytes on transparent huge pages where Linux offers them
    (MADV_HUGEPAGE: the default THP setting, "madvise", gives them only to memory that
    asks). One decoding row streams every packed weight from memory, and on 4 KiB
    pages the TLB misses showed: one row of the 1B rung's Q6_K LM head took 25.0 ms
    on one thread against 16.8 ms on huge pages, and its blocks read from the GGUF's
    mapping 16.7-17.2 ms (docs/perf/decode-step.md, "Q6_K packed")."""
    if size <= 0:
        return torch.empty(0, dtype=torch.uint8)
    buffer = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is not None:
        try:
            buffer.madvise(advice)
        except OSError:  # a kernel built without THP: 4 KiB pages, the same bytes
            pass
    return torch.frombuffer(buffer, dtype=torch.uint8)


def ggml_unpack(packed: torch.Tensor, qtype: GGMLQuantizationType, n: int, k: int) -> torch.Tensor:
    """The [n, row_bytes] blocks that ggml_pack packed (a copy), bit for bit."""
    lib = _library(_any_isa())
    if lib is None or packed.numel() != lib.ggml_quant_packed_bytes(int(qtype), n, k):
        raise ValueError(f"not a packed {qtype.name} weight of {n} x {k}")
    block_elems, type_size = GGML_QUANT_SIZES[qtype]
    blocks = torch.empty(n, k // block_elems * type_size, dtype=torch.uint8)
    lib.ggml_quant_pack(int(qtype), packed.data_ptr(), n, k, blocks.data_ptr(), 1, torch.get_num_threads())
    return blocks


def ggml_matmul_packed(
    x: torch.Tensor, packed: torch.Tensor, qtype: GGMLQuantizationType, n: int, out: torch.Tensor | None = None
) -> torch.Tensor | None:
    """ggml_matmul for a weight of n rows packed by ggml_pack: the same result bit
    for bit. None where the path in use does not multiply packed weights."""
    if qtype not in SUPPORTED_TYPES or not packs(qtype) or not _served(x):
        return None
    k = x.shape[-1] if x.dim() == 2 else -1
    packer = _library(_any_isa())
    if k <= 0 or packer is None or packed.numel() != packer.ggml_quant_packed_bytes(int(qtype), n, k):
        raise ValueError(f"x must be [m, k] for a packed {qtype.name} weight of {n} rows, got {tuple(x.shape)}")
    return _matmul(x, packed, qtype, k, n, out, packed=True)


@cache
def _any_isa() -> str:
    """The path whose build packs and unpacks (the layout is the same in every build)."""
    return _available()[0]


def _matmul(
    x: torch.Tensor,
    weight: torch.Tensor,
    qtype: GGMLQuantizationType,
    k: int,
    n: int,
    out: torch.Tensor | None,
    packed: bool,
) -> torch.Tensor | None:
    lib = _lib()
    assert lib is not None  # _served
    block_elems = GGML_QUANT_SIZES[qtype][0]
    if x.dim() != 2:
        raise ValueError(f"x must be 2-D [m, k], got {tuple(x.shape)}")
    if x.shape[1] % block_elems:
        raise ValueError(f"k={x.shape[1]} is not a multiple of {qtype.name}'s {block_elems}-element block")
    if x.shape[1] != k:
        raise ValueError(f"x must be [m, {k}] for this weight, got {tuple(x.shape)}")
    m = x.shape[0]
    x = x.contiguous()
    if out is None:
        out = torch.empty(m, n, dtype=x.dtype)
    elif out.shape != (m, n) or out.dtype != x.dtype or not out.is_cpu or (m and out.stride(1) != 1):
        raise ValueError(f"out must be a CPU [{m}, {n}] {x.dtype} tensor with stride(1) == 1")
    elif m > 1 and out.stride(0) < n:
        raise ValueError("out rows must not overlap (stride(0) >= n)")
    call = lib.ggml_quant_matmul_packed if packed else lib.ggml_quant_matmul
    rc = call(
        int(qtype),
        x.data_ptr(),
        int(x.dtype == torch.bfloat16),
        m,
        k,
        weight.data_ptr(),
        n,
        out.data_ptr(),
        out.stride(0),
        torch.get_num_threads(),
    )
    if rc == 1:
        raise MemoryError("the quantized matmul could not allocate its scratch memory")
    if rc != 0:
        raise ValueError(f"the quantized matmul rejected {qtype.name} with k={k}")
    return out


def ggml_dequantize_rows(
    weight: torch.Tensor, qtype: GGMLQuantizationType, rows: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor | None:
    """The rows `rows` (int64 [r]) of W dequantized, [r, k] in dtype (fp32 or bf16):
    embedding lookups from a quantized table. fp32 matches gguf-py's dequantize bit
    for bit. None when the kernel cannot serve the call."""
    if qtype not in SUPPORTED_TYPES or not weight.is_cpu or dtype not in (torch.float32, torch.bfloat16):
        return None
    lib = _lib()
    if lib is None:
        return None
    k = _row_elems(weight, qtype)
    if rows.dtype != torch.int64 or rows.dim() != 1:
        raise ValueError("rows must be a 1-D int64 tensor")
    rows = rows.contiguous()
    if rows.numel() and (int(rows.min()) < 0 or int(rows.max()) >= weight.shape[0]):
        raise ValueError(f"row index out of range for a table of {weight.shape[0]} rows")
    out = torch.empty(rows.numel(), k, dtype=dtype)
    rc = lib.ggml_quant_dequantize_rows(
        int(qtype),
        weight.data_ptr(),
        k,
        rows.data_ptr(),
        rows.numel(),
        out.data_ptr(),
        int(dtype == torch.bfloat16),
        torch.get_num_threads(),
    )
    if rc != 0:
        raise ValueError(f"dequantizing {qtype.name} rows with k={k} failed")
    return out
