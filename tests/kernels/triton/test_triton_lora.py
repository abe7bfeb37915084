"""LoRA's segmented products (``kernels/triton/lora.py``) through Triton's interpreter on
CPU: equal to the plain-torch reference (and so to the engine's per-group products) up
to fp32 summation order, over groups of every length, groups without an adapter, ranks
that are no power of two, adapters' ranks padded with zeros, and widths that are no
multiple of a tile."""

from __future__ import annotations

import itertools

import pytest
import torch

from engine.lora.adapter import LoraWeights
from engine.lora.layers import LoraStep
from engine.lora.ops import DenseLora, lora_delta
from kernels.reference import lora as reference


@pytest.fixture(scope="module")
def ops():  # imported here: conftest sets TRITON_INTERPRET before kernels.triton loads
    from kernels.triton import lora

    return lora


@pytest.mark.parametrize(("in_features", "out_features", "rank"), [(48, 40, 4), (96, 72, 24)])
def test_shrink_and_expand_equal_the_reference(
    ops, device, in_features: int, out_features: int, rank: int
) -> None:
    gen = torch.Generator().manual_seed(rank)
    # an empty group, one of 17 (two tiles), one of 1; the last under a slot past the
    # three stacked (a projection no adapter in a later slot targets): none
    offsets_list = [0, 3, 3, 20, 21, 38, 40, 42]
    ids_list = [2, 0, -1, 1, 0, 2, 5]
    x = torch.randn(42, in_features, generator=gen)
    a = torch.randn(3, rank, in_features, generator=gen)
    b = torch.randn(3, rank, out_features, generator=gen)
    a[1, rank // 2 :] = b[1, rank // 2 :] = 0.0  # adapter 1 of half the rank, padded
    offsets = torch.tensor(offsets_list, dtype=torch.int32)
    ids = torch.tensor(ids_list, dtype=torch.int32)
    longest = max(e - s for s, e in itertools.pairwise(offsets_list))
    args = (offsets.to(device), ids.to(device), longest)
    y = ops.sgmv_shrink(x.to(device), a.to(device), *args)
    want_y = reference.sgmv_shrink(x, a, offsets, ids, longest)
    assert torch.allclose(y.cpu(), want_y, atol=1e-4, rtol=1e-4)
    assert not y[3:20].any() and not y[40:].any()  # the groups without an adapter
    out = ops.sgmv_expand(y, b.to(device), *args)
    want = reference.sgmv_expand(want_y, b, offsets, ids, longest)
    assert torch.allclose(out.cpu(), want, atol=1e-3, rtol=1e-4)
    # What the engine's per-group products give, with the adapters as it holds them.
    weights = [LoraWeights(a[s], b[s].T.contiguous(), 1.0) for s in range(3)]
    engine = lora_delta(x, offsets_list, ids_list, weights, out_features)
    assert torch.allclose(out.cpu(), engine, atol=1e-3, rtol=1e-4)


def test_nothing_to_do_gives_zeros(ops, device) -> None:
    x = torch.randn(5, 32)
    a, b = torch.randn(2, 16, 32), torch.randn(2, 16, 24)
    offsets = torch.tensor([0, 5], dtype=torch.int32, device=device)
    ids = torch.tensor([-1], dtype=torch.int32, device=device)
    y = ops.sgmv_shrink(x.to(device), a.to(device), offsets, ids, 5)
    out = ops.sgmv_expand(y, b.to(device), offsets, ids, 5)
    assert y.shape == (5, 16) and out.shape == (5, 24)
    assert not y.any() and not out.any()


def test_the_engines_gpu_path_equals_its_dense_path(ops, device) -> None:
    """``DenseLora.segmented`` with these kernels (what ``LoraLinear`` runs on CUDA) gives
    each token what the CPU's dense path gives it: a fused projection's three parts, one
    of them without adapters, adapters of other ranks, a group without one."""
    gen = torch.Generator().manual_seed(3)

    def weights(r: int, out: int) -> LoraWeights:
        return LoraWeights(
            torch.randn(r, 40, generator=gen), torch.randn(out, r, generator=gen), 0.5
        )

    parts = [
        [weights(4, 24), None, weights(8, 24)],
        [None, None, None],
        [weights(2, 16), weights(6, 16), None],
    ]
    dense = DenseLora(parts, 40, [24, 8, 16], torch.device(device))
    step = LoraStep([0, 2, 3, 9, 10, 12], [2, -1, 0, 1, 2])
    x = torch.randn(12, 40, generator=gen).to(device)
    got = dense.segmented(x, step.device_groups(x.device), ops)
    want = dense.deltas(x, step.mask(dense.num_slots, x.device))
    assert got.shape == (12, 48)
    assert torch.allclose(got.cpu(), want.cpu(), atol=1e-3, rtol=1e-4)
