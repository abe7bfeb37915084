"""GGUF's Q4_0, Q4_1 and Q8_0 blocks (kernels/cpu/gguf_linear.cpp and its reference):
the packed layout reads back to exactly what gguf's own ``dequantize`` gives for blocks
made by gguf's own ``quantize``; the kernel's products match the dequantized weight's in
float64 within the error its int16 activations allow, with bias, for every row count
around its 8-row tile; and a row's output is the same whatever rows share its call."""

from __future__ import annotations

import gguf
import pytest
import torch
from gguf import GGMLQuantizationType as QType

from kernels.cpu.gguf_linear import HugePageArena, dequantize_packed, kernel_runs, linear, pack

TYPES = [QType.Q4_0, QType.Q4_1, QType.Q8_0]


def blocks(qtype: QType, n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(the file's blocks [n, bytes], gguf's dequantization of them [n, k]) for a random
    weight whose 32-column blocks span three orders of magnitude."""
    g = torch.Generator().manual_seed(seed)
    spread = 10 ** (torch.rand(n, k // 32, generator=g) * 3 - 2)
    weight = torch.randn(n, k, generator=g) * spread.repeat_interleave(32, 1)
    raw = gguf.quants.quantize(weight.numpy(), qtype)
    return torch.from_numpy(raw).view(torch.uint8), torch.from_numpy(
        gguf.quants.dequantize(raw, qtype)
    )


@pytest.mark.parametrize("qtype", TYPES)
def test_packed_blocks_read_back_as_ggufs_dequantize(qtype) -> None:
    raw, want = blocks(qtype, 48, 96, seed=1)
    packed = pack(qtype, raw)
    assert packed.shape == (3, 3, 16 * raw.shape[1] // 3) and packed.dtype == torch.uint8
    assert torch.equal(dequantize_packed(qtype, packed), want)
    rows = torch.tensor([0, 17, 47, 17])
    assert torch.equal(dequantize_packed(qtype, packed, rows), want[rows])


@pytest.mark.skipif(not kernel_runs(), reason="needs the CPU kernels and AVX-512 VNNI")
@pytest.mark.parametrize("qtype", TYPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_matches_the_dequantized_product(qtype, dtype) -> None:
    n, k = 64, 256
    raw, weight = blocks(qtype, n, k, seed=2)
    packed = pack(qtype, raw)
    g = torch.Generator().manual_seed(3)
    bias = torch.randn(n, generator=g)
    for rows in (1, 2, 3, 7, 8, 9, 13, 16):
        x = (torch.randn(rows, k, generator=g) * 3).to(dtype)
        got = linear(x, packed, qtype, n, bias.to(dtype))
        assert got.dtype == dtype and got.shape == (rows, n)
        want = x.double() @ weight.double().T + bias.to(dtype).double()
        # Each block of x in int16: an error under 2^-15 of the block's largest value per
        # element; bf16's output rounding (2^-9 relative) on top.
        scale = (
            x.double().abs().view(rows, -1, 32).amax(2)
            @ weight.abs().double().view(n, -1, 32).sum(2).T
        )
        bound = scale * 2**-15 + (want.abs() * 2**-8 if dtype == torch.bfloat16 else 0) + 1e-4
        assert ((got.double() - want).abs() <= bound).all(), (
            rows,
            (got.double() - want).abs().max(),
        )


@pytest.mark.skipif(not kernel_runs(), reason="needs the CPU kernels and AVX-512 VNNI")
@pytest.mark.parametrize("qtype", TYPES)
def test_a_rows_output_does_not_depend_on_its_batch(qtype) -> None:
    """Speculative verification runs K+1 rows where plain decoding runs one: each row is
    quantized and summed alone, so its output is bit for bit the same."""
    raw, _ = blocks(qtype, 32, 128, seed=4)
    packed = pack(qtype, raw)
    x = torch.randn(13, 128, generator=torch.Generator().manual_seed(5)).bfloat16()
    together = linear(x, packed, qtype, 32)
    for i in (0, 6, 12):
        assert torch.equal(linear(x[i : i + 1], packed, qtype, 32), together[i : i + 1])
    assert linear(x[:0], packed, qtype, 32).shape == (0, 32)


@pytest.mark.skipif(not kernel_runs(), reason="needs the CPU kernels and AVX-512 VNNI")
def test_bad_arguments_are_refused() -> None:
    raw, _ = blocks(QType.Q4_1, 32, 64, seed=6)
    packed = pack(QType.Q4_1, raw)
    x = torch.randn(1, 64).bfloat16()
    with pytest.raises(RuntimeError, match="type 7 is not Q4_0"):
        torch.ops.tandem_cpu.gguf_linear(x, packed, 7, 32, None)
    with pytest.raises(RuntimeError, match="packed must be a contiguous uint8"):
        torch.ops.tandem_cpu.gguf_linear(x, packed, int(QType.Q8_0), 32, None)
    with pytest.raises(RuntimeError, match="K 48"):
        torch.ops.tandem_cpu.gguf_linear(torch.randn(1, 48), packed, int(QType.Q4_1), 32, None)


def test_the_arena_places_tensors_on_cache_lines_and_keeps_them() -> None:
    tensors = [torch.arange(n, dtype=torch.uint8).view(-1, 1) for n in (100, 64, 3)]
    arena = HugePageArena(HugePageArena.size_of(tensors))
    assert arena.nbytes == 128 + 64 + 64
    placed = [arena.place(t) for t in tensors]
    del arena  # the views keep the mapping
    for t, p in zip(tensors, placed, strict=True):
        assert torch.equal(p, t) and p.data_ptr() % 64 == placed[0].data_ptr() % 64
    with pytest.raises(ValueError, match="no room"):
        small = HugePageArena(64)
        small.place(tensors[0])
