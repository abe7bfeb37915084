"""Products with GGUF's Q4_0, Q4_1 and Q8_0 weights kept in their blocks:
``gguf_linear.cpp`` (built by ``extension``), and its plain-torch reference here.

``pack`` reorders a tensor's blocks as the file holds them (``[rows, blocks x bytes]``)
into the kernel's layout, 16 rows side by side per block; ``dequantize_packed`` reads
that layout back to float32 exactly as gguf's own ``dequantize`` does (the reference,
and a tied embedding's lookup); ``reference_linear`` is the product the kernel computes,
on aten. The kernel quantizes each row of x to int16 per block of 32 and sums each
block's products exactly in int32 (AVX-512 VNNI), scaled per block in fp32.

``python -m kernels.cpu.gguf_linear [THREADS]`` times the products at SmolLM2-135M's
shapes, weights cache-hot.
"""

from __future__ import annotations

import functools
import mmap
import sys
import time

import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as QType

from kernels.cpu.extension import available

__all__ = [
    "BLOCK",
    "BLOCK_BYTES",
    "ROWS",
    "HugePageArena",
    "dequantize_packed",
    "kernel_runs",
    "linear",
    "pack",
    "reference_linear",
]

BLOCK = 32  # elements per block of every type kept quantized
ROWS = 16  # rows per packed group: one lane each in the kernel
BLOCK_BYTES = {QType.Q4_0: 18, QType.Q4_1: 20, QType.Q8_0: 34}  # the file's, per block


def pack(qtype: QType, raw: torch.Tensor) -> torch.Tensor:
    """The file's blocks [N, B x bytes] -> the kernel's [N / 16, B, group-block bytes]:
    per block, the 16 rows' scales (and minimums), then their quants interleaved
    (``kernels/cpu/gguf_linear.cpp`` describes the layout)."""
    n = raw.shape[0]
    blocks = raw.view(n // ROWS, ROWS, -1, BLOCK_BYTES[qtype])  # [G, 16, B, bytes]
    head = 4 if qtype == QType.Q4_1 else 2  # d (and m), fp16 each
    scales = blocks[..., :head].reshape(n // ROWS, ROWS, -1, head // 2, 2)
    scales = scales.permute(0, 2, 3, 1, 4).flatten(2)  # [G, B, (d[16], m[16]) bytes]
    quants = blocks[..., head:]
    if qtype == QType.Q8_0:  # [G, B, pair, row, 2]
        quants = quants.reshape(n // ROWS, ROWS, -1, 16, 2).permute(0, 2, 3, 1, 4)
    else:  # [G, B, 4-byte run, row, 4]
        quants = quants.reshape(n // ROWS, ROWS, -1, 4, 4).permute(0, 2, 3, 1, 4)
    return torch.cat([scales, quants.flatten(2)], dim=2).contiguous()


def dequantize_packed(
    qtype: QType, packed: torch.Tensor, rows: torch.Tensor | None = None
) -> torch.Tensor:
    """Packed weights -> float32 [N, K] (or only ``rows``), as gguf's dequantize computes
    them: the plain-torch reference of the kernel, and a tied embedding's lookup."""
    groups, blocks, _ = packed.shape
    if rows is None:
        rows = torch.arange(groups * ROWS)
    g, lane = rows // ROWS, rows % ROWS
    sel = packed[g]  # [R, B, bytes]
    d = sel[..., : 2 * ROWS].view(torch.float16).float()  # [R, B, 16]
    d = d.gather(2, lane.view(-1, 1, 1).expand(-1, blocks, 1))  # [R, B, 1]
    if qtype == QType.Q8_0:
        quants = sel[..., 2 * ROWS :].reshape(len(rows), blocks, 16, ROWS, 2)
        pick = lane.view(-1, 1, 1, 1, 1).expand(-1, blocks, 16, 1, 2)
        q = quants.gather(3, pick).view(torch.int8).reshape(len(rows), blocks, BLOCK).float()
        return (d * q).reshape(len(rows), blocks * BLOCK)
    start = 4 * ROWS if qtype == QType.Q4_1 else 2 * ROWS
    quants = sel[..., start:].reshape(len(rows), blocks, 4, ROWS, 4)
    pick = lane.view(-1, 1, 1, 1, 1).expand(-1, blocks, 4, 1, 4)
    byte = quants.gather(3, pick).reshape(len(rows), blocks, 16)
    q = torch.cat([byte & 0x0F, byte >> 4], dim=2).float()  # [R, B, 32]
    if qtype == QType.Q4_0:
        out = d * (q - 8)
    else:
        m = sel[..., 2 * ROWS : 4 * ROWS].view(torch.float16).float()
        m = m.gather(2, lane.view(-1, 1, 1).expand(-1, blocks, 1))
        out = d * q + m
    return out.reshape(len(rows), blocks * BLOCK)


@functools.cache
def kernel_runs() -> bool:
    """Whether ``gguf_linear`` runs here (the C++ kernels, and AVX-512 VNNI)."""
    return available() and bool(torch.ops.tandem_cpu.gguf_kernel_supported())


def reference_linear(
    x: torch.Tensor, packed: torch.Tensor, qtype: QType, bias: torch.Tensor | None
) -> torch.Tensor:
    """The product the kernel approximates: the weight dequantized, then aten's."""
    return F.linear(x, dequantize_packed(qtype, packed).to(x.dtype), bias)


class HugePageArena:
    """One anonymous mapping, backed by 2 MB pages where the kernel grants them
    (``madvise(MADV_HUGEPAGE)``: transparent huge pages set to "madvise", as here), that
    holds every packed weight of a model side by side. A product streams its weights: on
    4 KB pages each 4 KB costs a TLB walk, and one thread read SmolLM2's Q4_1 weights at
    7.3 GB/s on them against 11.5 GB/s here (bench/RESULTS.md, 2026-11-30)."""

    ALIGN = 64  # each tensor starts on a cache line

    def __init__(self, nbytes: int) -> None:
        self.nbytes = max(nbytes, 1)
        self._map = mmap.mmap(-1, self.nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        self.huge = False
        if hasattr(mmap, "MADV_HUGEPAGE"):
            try:
                self._map.madvise(mmap.MADV_HUGEPAGE)
                self.huge = True
            except OSError:  # a kernel without transparent huge pages
                pass
        self._bytes = torch.frombuffer(self._map, dtype=torch.uint8)
        self._used = 0

    @staticmethod
    def size_of(tensors: list[torch.Tensor]) -> int:
        """The bytes an arena needs to hold ``tensors``."""
        align = HugePageArena.ALIGN
        return sum(-(-t.numel() * t.element_size() // align) * align for t in tensors)

    def place(self, tensor: torch.Tensor) -> torch.Tensor:
        """A copy of the uint8 ``tensor`` in the arena (which its views keep alive)."""
        start, size = self._used, tensor.numel()
        if start + size > self.nbytes:
            raise ValueError(f"arena of {self.nbytes} bytes: no room for {size} more")
        view = self._bytes[start : start + size].view(tensor.shape)
        view.copy_(tensor)
        self._used = start + -(-size // self.ALIGN) * self.ALIGN
        return view


def linear(
    x: torch.Tensor, packed: torch.Tensor, qtype: QType, n: int, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x [..., K] (bf16 or fp32) times the packed [n, K] weight, plus ``bias``: the kernel
    where it runs, else ``reference_linear``."""
    if not kernel_runs() or x.dtype not in (torch.bfloat16, torch.float32):
        return reference_linear(x, packed, qtype, bias)
    flat = x.reshape(-1, x.shape[-1]).contiguous()
    out: torch.Tensor = torch.ops.tandem_cpu.gguf_linear(flat, packed, int(qtype), n, bias)
    return out.view(*x.shape[:-1], n)


def _bench(threads: int) -> None:
    """Microseconds per product at SmolLM2-135M's shapes, batch 1 and 8, cache-hot."""
    torch.set_num_threads(threads)
    shapes = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}
    for qtype in (QType.Q4_1, QType.Q8_0):
        for name, (n, k) in shapes.items():
            raw = torch.randint(0, 256, (n, k // BLOCK * BLOCK_BYTES[qtype]), dtype=torch.uint8)
            raw.view(n, k // BLOCK, -1)[..., :2] = torch.tensor([0, 0x20], dtype=torch.uint8)
            packed = pack(qtype, raw)
            for rows in (1, 8):
                x = torch.randn(rows, k).bfloat16()
                for _ in range(20):
                    linear(x, packed, qtype, n)
                start, calls = time.perf_counter(), 300
                for _ in range(calls):
                    linear(x, packed, qtype, n)
                us = (time.perf_counter() - start) / calls * 1e6
                print(f"{qtype.name} {name:8s} {n}x{k} rows {rows}: {us:7.1f} us")


if __name__ == "__main__":
    _bench(int(sys.argv[1]) if len(sys.argv) > 1 else 1)
