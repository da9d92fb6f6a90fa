"""Linear: the oneDNN-packed weight gives F.linear's result, with and without
bias, for every batch size, and falls back to F.linear when packing is off."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from stoker.models.layers import Linear, onednn_rows


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("with_bias", [False, True], ids=["no-bias", "bias"])
def test_packed_linear_matches_f_linear(dtype: torch.dtype, tol: float, with_bias: bool) -> None:
    g = torch.Generator().manual_seed(0)
    weight = (torch.randn(96, 64, generator=g) * 0.1).to(dtype)
    bias = torch.randn(96, generator=g).to(dtype) if with_bias else None
    layer = Linear(weight, bias)
    if not torch.backends.mkldnn.is_available():
        assert layer.packed is None
    for rows in (1, 7, 32, 300):  # one weight layout serves every batch size
        x = torch.randn(rows, 64, generator=g).to(dtype)
        torch.testing.assert_close(layer(x).float(), F.linear(x, weight, bias).float(), atol=tol, rtol=tol)


def test_packing_replaces_the_weight_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    if not torch.backends.mkldnn.is_available():
        pytest.skip("torch built without oneDNN")
    monkeypatch.delenv("STOKER_DISABLE_PACKED_LINEAR", raising=False)
    layer = Linear(torch.randn(32, 16))
    assert layer.packed is not None and layer.weight is None  # no second copy of the weights is kept


def test_disabled_packing_is_plain_f_linear(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STOKER_DISABLE_PACKED_LINEAR", "1")
    weight = torch.randn(8, 4)
    layer = Linear(weight)
    assert layer.packed is None
    x = torch.randn(3, 4)
    assert torch.equal(layer(x), F.linear(x, weight))


def test_packing_leaves_the_global_rng_alone() -> None:
    """Loading a model must not change what a user's seeded torch code draws next."""
    torch.manual_seed(1)
    expected = torch.rand(4)
    torch.manual_seed(1)
    Linear(torch.randn(32, 16, generator=torch.Generator().manual_seed(2)))
    assert torch.equal(torch.rand(4), expected)


def test_row_counts_are_bucketed_to_few_shapes() -> None:
    rows = [onednn_rows(m) for m in range(1, 2049)]
    assert rows[:16] == list(range(1, 17))  # decode batches run unpadded
    assert all(m <= r <= m * 1.125 for m, r in zip(range(1, 2049), rows))
    assert len(set(rows)) == 16 + 8 * 7  # 8 shapes per octave from 17 to 2048


@pytest.mark.parametrize("m", [1, 16, 17, 100, 511])
def test_padded_rows_do_not_change_the_result(m: int) -> None:
    torch.manual_seed(0)
    weight, bias, x = torch.randn(48, 32), torch.randn(48), torch.randn(m, 32)
    linear = Linear(weight, bias)
    assert linear.packed is not None
    y = linear(x)
    assert y.shape == (m, 48)
    torch.testing.assert_close(y, F.linear(x, weight, bias), rtol=1e-4, atol=1e-4)
