"""A GGUF holding a subset of another GGUF's decoder layers: the same metadata
(tokenizer included), embeddings, final norm and LM head, the kept blocks
renumbered 0 .. n - 1 and `<arch>.block_count` set to n. Tensors are copied
byte for byte in their own quantization, so the subset computes exactly what
those layers of the source compute.

It is a self-draft for speculative decoding built from the target's own
weights (early exit: the first n layers; layer skip: every other layer),
served through the ordinary draft-model path
(`--speculative-method draft --speculative-model SUBSET.gguf`).
"""

from __future__ import annotations

import re
from pathlib import Path

from gguf import GGUFReader, GGUFValueType, GGUFWriter

_BLOCK = re.compile(r"^blk\.(\d+)\.(.+)$")


def parse_layers(spec: str, num_layers: int) -> list[int]:
    """Layer indices from a spec: `first:N` (early exit), `every:S` (layers 0, S,
    2S, ..), `drop:S` (all but every S-th layer: S - 1 of every S kept), or
    explicit indices `0;1;5`. ValueError naming the spec otherwise."""
    kind, _, value = spec.partition(":")
    try:
        if kind == "first":
            n = int(value)
            layers = list(range(n))
        elif kind == "every":
            step = int(value)
            if step < 1:
                raise ValueError
            layers = list(range(0, num_layers, step))
        elif kind == "drop":
            step = int(value)
            if step < 2:
                raise ValueError
            layers = [i for i in range(num_layers) if i % step != step - 1]
        else:
            layers = sorted({int(x) for x in re.split(r"[,;]", spec)})
    except ValueError:
        raise ValueError(f"layer spec {spec!r}: use first:N, every:S, drop:S or indices like 0;1;5") from None
    if not layers or layers[0] < 0 or layers[-1] >= num_layers:
        raise ValueError(f"layer spec {spec!r}: needs 1 or more layers within 0..{num_layers - 1}")
    return layers


def block_count(reader: GGUFReader) -> tuple[str, int]:
    """(the block-count key, its value) of a GGUF: `<general.architecture>.block_count`."""
    arch = reader.get_field("general.architecture")
    if arch is None:
        raise ValueError("not a model GGUF: no general.architecture")
    key = f"{arch.contents()}.block_count"
    field = reader.get_field(key)
    if field is None:
        raise ValueError(f"not a decoder GGUF: no {key}")
    return key, int(field.contents())


def write_layer_subset(source: str | Path, dest: str | Path, layers: list[int]) -> Path:
    """Write the GGUF at `source` with only `layers` (source indices, kept in
    this order) to `dest`. Returns dest."""
    reader = GGUFReader(str(source))
    count_key, num_layers = block_count(reader)
    if not layers or any(not 0 <= i < num_layers for i in layers) or len(set(layers)) != len(layers):
        raise ValueError(f"layers {layers}: need distinct indices within 0..{num_layers - 1}")
    renumber = {old: new for new, old in enumerate(layers)}
    arch = reader.get_field("general.architecture")
    assert arch is not None  # block_count checked it
    writer = GGUFWriter(str(dest), str(arch.contents()), endianess=reader.endianess)
    for field in reader.fields.values():
        # GGUF.* are the header's own fields and the writer adds the architecture itself.
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        value_type = field.types[0]
        sub_type = field.types[-1] if value_type == GGUFValueType.ARRAY else None
        value = len(layers) if field.name == count_key else field.contents()
        writer.add_key_value(field.name, value, value_type, sub_type=sub_type)

    kept = []
    for tensor in reader.tensors:
        match = _BLOCK.match(tensor.name)
        if match is None:
            kept.append((tensor.name, tensor))
        elif int(match.group(1)) in renumber:
            kept.append((f"blk.{renumber[int(match.group(1))]}.{match.group(2)}", tensor))
    # Blocks in their new order, so the file reads like one converted that way.
    kept.sort(key=lambda item: _order(item[0]))
    for name, tensor in kept:
        writer.add_tensor_info(name, tensor.data.shape, tensor.data.dtype, tensor.data.nbytes, tensor.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for _, tensor in kept:
        writer.write_tensor_data(tensor.data, tensor_endianess=reader.endianess)
    writer.close()
    return Path(dest)


def _order(name: str) -> tuple[int, int, str]:
    """token_embd first, then blocks by number, then the rest (output_norm, output)."""
    match = _BLOCK.match(name)
    if match:
        return (1, int(match.group(1)), match.group(2))
    return (0 if name.startswith("token_embd") else 2, 0, name)
