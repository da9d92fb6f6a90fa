"""Parts of a fused projection that lie side by side in the GGUF (q, k, v; gate,
up) are joined as one view of the mapped file, not copied: resident memory
stays the file's (a copy's given-back pages came back whenever a neighbour's
fault mapped their 2 MiB folio) and the load copies nothing. Parts that are not
side by side are still copied into one matrix; either way the blocks and the
model's greedy tokens are what the copy gave."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType as T
from quant_models import write_quant_gguf

from stoker import LLM, SamplingParams
from stoker.models.quant.weights import GGMLLinear, GGMLTensor

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(autouse=True)
def _blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    """The join itself, before any packing: a packed run holds panels, not the joined blocks
    (tests/unit/models/test_packed_panels.py)."""
    monkeypatch.setenv("STOKER_DISABLE_PACKED_GGML", "1")


def _q8(data: torch.Tensor, file_mapped: bool = False) -> GGMLTensor:
    return GGMLTensor(data, T.Q8_0, data.shape[1] // 34 * 32, file_mapped=file_mapped)


def test_side_by_side_parts_are_one_view_and_others_one_copy() -> None:
    storage = torch.randint(0, 256, (10 * 68,), dtype=torch.uint8)
    a, b, c = (_q8(storage[i * 136 : (i + 1) * 136].view(2, 68)) for i in range(3))
    joined = GGMLLinear([a, b, c]).parts[0].tensor
    assert joined.data.data_ptr() == a.data.data_ptr()  # a view: nothing copied
    assert torch.equal(joined.data, torch.cat([a.data, b.data, c.data]))

    gap = _q8(storage[4 * 136 : 5 * 136].view(2, 68))  # not where a ends
    copied = GGMLLinear([a, gap]).parts[0].tensor
    assert copied.data.data_ptr() != a.data.data_ptr()
    assert torch.equal(copied.data, torch.cat([a.data, gap.data]))

    elsewhere = _q8(b.data.clone())  # the same bytes in another storage
    assert GGMLLinear([a, elsewhere]).parts[0].tensor.data.data_ptr() != a.data.data_ptr()


def _mapped_span(path: Path) -> tuple[int, int]:
    with open("/proc/self/maps") as f:
        for line in f:
            if line.rstrip().endswith(str(path)):
                lo, hi = line.split()[0].split("-")
                return int(lo, 16), int(hi, 16)
    raise AssertionError(f"{path} is not mapped")


def test_a_gguf_s_fused_projections_view_the_file_and_decode_as_the_copies_did(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # llama: gate and up side by side (q and k are copies anyway, un-permuted from llama.cpp's order).
    path = write_quant_gguf(tmp_path / "tiny-llama.gguf", "llama", {}, T.Q4_0)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    prompts = [[5, 9, 14, 3, 7], [11, 2, 8]]

    def load_and_decode() -> tuple[GGMLTensor, list[list[int]]]:
        llm = LLM(str(path), dtype="float32", quantization="auto", num_kv_blocks=64)
        layer = llm.engine.runner.model.layers[0]
        assert isinstance(layer.gate_up, GGMLLinear) and len(layer.gate_up.parts) == 1
        tokens = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params)]
        return layer.gate_up.parts[0].tensor, tokens

    viewed, viewed_tokens = load_and_decode()
    lo, hi = _mapped_span(path)
    assert lo <= viewed.data.data_ptr() < hi
    monkeypatch.setattr("stoker.models.quant.weights._side_by_side", lambda run: False)  # the copies, as before
    copied, copied_tokens = load_and_decode()
    assert not lo <= copied.data.data_ptr() < hi
    assert torch.equal(viewed.data, copied.data)
    assert viewed_tokens == copied_tokens and all(len(t) == 8 for t in viewed_tokens)
