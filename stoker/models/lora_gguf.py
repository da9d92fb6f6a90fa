"""llama.cpp GGUF LoRA files (convert_lora_to_gguf.py's output) read into a LoraAdapter.

Such a file has general.type "adapter", adapter.type "lora" and adapter.lora.alpha;
each adapted tensor `blk.N.<ggml name>.weight` has `.lora_a` (A, [r, in]) and
`.lora_b` (B, [out, r]) beside it, in any type the gguf package reads. As
llama.cpp does, the update is scaled by alpha / r (by 1 where alpha is 0). Names
map to Hugging Face modules through the base family's registry entry, and a
family whose GGUF stores q/k rows interleaved gets B's rows of q and k permuted
back, as its base weights are (gguf_loader.py).
"""

from __future__ import annotations

import struct
from typing import Any

import numpy as np
import torch

from stoker.config import ModelConfig
from stoker.models.gguf_loader import unpermute_qk_rows
from stoker.models.lora import LoraAdapter, LoraError, ModuleWeights, build_adapter, check_target
from stoker.models.registry import architecture


def load_gguf_lora(name: str, path: str, config: ModelConfig, max_rank: int) -> LoraAdapter:
    from gguf import GGUFReader
    from gguf.quants import dequantize

    try:
        reader = GGUFReader(path)
    except (ValueError, IndexError, KeyError, OSError, struct.error) as exc:
        raise LoraError.of(name, f"{path}: neither a PEFT folder nor a readable GGUF file ({exc})") from exc

    def field(key: str) -> Any:
        f = reader.fields.get(key)
        return None if f is None else f.contents()

    kind, adapter_type = field("general.type"), field("adapter.type")
    if kind != "adapter":
        raise LoraError.of(name, f"{path} is a GGUF {kind or 'model'}, not an adapter (general.type {kind!r})")
    if adapter_type != "lora":
        raise LoraError.of(name, f"adapter.type {adapter_type!r} is not supported (only lora)")
    if field("adapter.alora.invocation_tokens") is not None:
        raise LoraError.of(name, "activated LoRA (adapter.alora.invocation_tokens) is not supported")
    facts = architecture(config.architecture).gguf
    made_for = field("general.architecture")
    if facts is None or made_for != facts.architecture:
        base = facts.architecture if facts else config.architecture
        raise LoraError.of(name, f"made for a {made_for!r} model; the base is {base!r} (an adapter of another base)")
    alpha = float(field("adapter.lora.alpha") or 0.0)

    found: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for t in reader.tensors:
        base_name, _, which = t.name.rpartition(".")
        if which not in ("lora_a", "lora_b"):
            raise LoraError.of(name, f"tensor {t.name!r} is neither a lora_a nor a lora_b")
        hf = facts.tensors.hf_name(base_name)
        if hf is None or not hf.startswith("model.layers."):
            top = {"model.embed_tokens.weight": "embed_tokens", "lm_head.weight": "lm_head"}.get(hf or "")
            if top is not None:
                check_target(name, top)  # names what is not supported
            raise LoraError.of(name, f"tensor {t.name!r} adapts no projection of a decoder layer")
        parts = hf.split(".")
        module = parts[-2]
        check_target(name, module)
        try:
            values = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32)
        except (NotImplementedError, ValueError, TypeError) as exc:
            raise LoraError.of(name, f"tensor {t.name!r}: type {t.tensor_type.name} is unreadable ({exc})") from exc
        found.setdefault((int(parts[2]), module), {})[which] = torch.from_numpy(values.copy())

    modules: dict[tuple[int, str], ModuleWeights] = {}
    for (layer, module), pair in sorted(found.items()):
        if set(pair) != {"lora_a", "lora_b"}:
            raise LoraError.of(name, f"layers.{layer}.{module} has {''.join(pair)} but not its pair")
        a, b = pair["lora_a"], pair["lora_b"]
        if a.dim() != 2 or b.dim() != 2:
            raise LoraError.of(name, f"layers.{layer}.{module}: lora_a and lora_b must be 2-D")
        rank = int(a.shape[0])
        heads = {"q_proj": config.num_heads, "k_proj": config.num_kv_heads}.get(module)
        if facts.qk_rows == "interleaved" and heads is not None and b.shape[0] % (2 * heads) == 0:
            b = unpermute_qk_rows(b, heads)
        modules[(layer, module)] = ModuleWeights(a, b, alpha / rank if alpha else 1.0)
    rank = max((int(w.a.shape[0]) for w in modules.values()), default=1)
    return build_adapter(name, path, config, max_rank, alpha / rank if alpha else 1.0, modules)
