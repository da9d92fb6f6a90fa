"""The `quantization` setting: its choices, whether this machine can honour one,
and quantizing dense weights (a Hugging Face folder, or a dequantized GGUF) at load.

What is quantized: the seven projections of every layer (q, k, v, o, gate, up,
down) to the requested type. The token embedding and an untied LM head go to
Q8_0 whatever was asked (as llama.cpp keeps token_embd/output at 8 bits or
better in its 4/5-bit mixes): they are the layers whose error every token sees,
and 8 bits costs little next to the float table. Norms and biases stay dense:
they are tiny, and the kernels only multiply.
"""

from __future__ import annotations

import logging
import time

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from stoker.models.quant.weights import GGMLTensor, WeightLike, quant_isa, served_types

log = logging.getLogger("stoker.models.quant")

QUANTIZE_AT_LOAD: dict[str, GGMLQuantizationType] = {
    "q8_0": GGMLQuantizationType.Q8_0,
    "int8": GGMLQuantizationType.Q8_0,  # int8 values, a scale per 32: q8_0 under its common name
    "q4_0": GGMLQuantizationType.Q4_0,
    "q4_1": GGMLQuantizationType.Q4_1,
    "q5_0": GGMLQuantizationType.Q5_0,
    "q5_1": GGMLQuantizationType.Q5_1,
}
"""The types gguf.quants.quantize implements (the K-quants it only dequantizes)."""
QUANTIZATION_CHOICES: tuple[str, ...] = ("auto", "none", *QUANTIZE_AT_LOAD)
EMBEDDING_TYPE = GGMLQuantizationType.Q8_0
"""Token embedding and LM head when quantizing at load."""
_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def check_quantization(quantization: str, device: str) -> None:
    """ValueError naming the flag and the choices unless this machine can do it."""
    choices = ", ".join(QUANTIZATION_CHOICES)
    if quantization not in QUANTIZATION_CHOICES:
        raise ValueError(f"quantization={quantization!r} is not a choice: {choices}")
    qtype = QUANTIZE_AT_LOAD.get(quantization)
    if qtype is None:
        return
    if torch.device(device).type != "cpu":
        raise ValueError(
            f"quantization={quantization!r} runs on the CPU int8 kernels only, not on {device}; "
            f"use auto or none there (choices: {choices})"
        )
    needed = {qtype, EMBEDDING_TYPE}
    if not needed <= served_types():
        served = ", ".join(sorted(t.name.lower() for t in served_types())) or "none"
        raise ValueError(
            f"quantization={quantization!r}: the int8 kernels on this machine (isa {quant_isa()}) serve {served}; "
            f"choices: {choices}"
        )


def quantize_weights(weights: dict[str, WeightLike], quantization: str) -> dict[str, WeightLike]:
    """The projections to QUANTIZE_AT_LOAD[quantization], embedding and LM head to
    EMBEDDING_TYPE; everything else (and any row length not a whole number of
    blocks) as given. GGMLTensors already present are dequantized first."""
    qtype = QUANTIZE_AT_LOAD[quantization]
    started = time.perf_counter()
    out: dict[str, WeightLike] = {}
    kept: list[str] = []
    for name, w in weights.items():
        target = _target_type(name, qtype)
        if target is None:
            out[name] = w
            continue
        dense = w.dequantize(torch.float32) if isinstance(w, GGMLTensor) else w.float()
        if dense.dim() != 2 or dense.shape[1] % GGML_QUANT_SIZES[target][0]:
            kept.append(name)
            out[name] = dense.to(w.dtype) if isinstance(w, torch.Tensor) else dense
            continue
        out[name] = quantize_tensor(dense, target)
    if kept:
        log.warning("%d tensors kept dense: rows not a whole number of blocks (%s, ...)", len(kept), kept[0])
    log.info("weights quantized to %s at load in %.1fs", qtype.name, time.perf_counter() - started)
    return out


def quantize_tensor(dense: torch.Tensor, qtype: GGMLQuantizationType) -> GGMLTensor:
    from gguf.quants import quantize

    blocks = quantize(dense.detach().cpu().float().numpy(), qtype)
    return GGMLTensor(torch.from_numpy(np.ascontiguousarray(blocks)), qtype, int(dense.shape[1]))


def _target_type(name: str, qtype: GGMLQuantizationType) -> GGMLQuantizationType | None:
    if name in ("model.embed_tokens.weight", "lm_head.weight"):
        return EMBEDDING_TYPE
    parts = name.split(".")
    if name.endswith(".weight") and len(parts) >= 2 and parts[-2] in _PROJECTIONS:
        return qtype
    return None
