"""LoRA's segmented products on the GPU (SGMV): the Triton form of
``kernels.reference.lora`` (the same names and signatures; read its docstring for the
layout). One program takes a tile of one group's tokens, and for ``sgmv_expand`` a tile of
output columns: it loads its group's adapter slot and bounds, and runs ``tl.dot`` over its
tokens' tile and the adapter's weights, in fp32 (IEEE products: not TF32, which
``tl.dot`` takes for fp32 on NVIDIA GPUs by default). Groups without an adapter, and tiles past
their group's end, return at once: the output starts as zeros. The grid's token tiles
cover ``max_group_len``, the longest group.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_M = 16  # tokens per program
BLOCK_K = 32  # input channels per shrink step
BLOCK_N = 32  # output columns per expand program


@triton.jit
def _group_tile(offsets_ptr, ids_ptr, S, BLOCK_M: tl.constexpr):
    """This program's group (axis 0) and token tile (axis 1): the group's adapter slot
    (-1: none, and so is a slot past the ``S`` stacked), the tile's first token and the
    group's end."""
    g = tl.program_id(0)
    end = tl.load(offsets_ptr + g + 1)
    slot = tl.load(ids_ptr + g).to(tl.int64)
    slot = tl.where(slot < S, slot, -1)
    first = tl.load(offsets_ptr + g) + tl.program_id(1) * BLOCK_M
    return slot, first, end


@triton.jit
def _shrink_kernel(
    x_ptr, a_ptr, y_ptr, offsets_ptr, ids_ptr, S, K, R,
    BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    slot, first, end = _group_tile(offsets_ptr, ids_ptr, S, BLOCK_M)
    if slot < 0 or first >= end:
        return
    rows = (first + tl.arange(0, BLOCK_M)).to(tl.int64)
    r = tl.arange(0, BLOCK_R)
    row_ok, r_ok = rows < end, r < R
    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < K
        x = tl.load(x_ptr + rows[:, None] * K + k[None, :],
                    mask=row_ok[:, None] & k_ok[None, :], other=0.0)  # fmt: skip
        a = tl.load(
            a_ptr + slot * R * K + r[None, :] * K + k[:, None],
            mask=k_ok[:, None] & r_ok[None, :],
            other=0.0,
        )  # [BLOCK_K, BLOCK_R]
        acc += tl.dot(x.to(tl.float32), a.to(tl.float32), input_precision="ieee")
    tl.store(y_ptr + rows[:, None] * R + r[None, :], acc, mask=row_ok[:, None] & r_ok[None, :])


@triton.jit
def _expand_kernel(
    y_ptr, b_ptr, out_ptr, offsets_ptr, ids_ptr, S, R, N,
    BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    slot, first, end = _group_tile(offsets_ptr, ids_ptr, S, BLOCK_M)
    if slot < 0 or first >= end:
        return
    rows = (first + tl.arange(0, BLOCK_M)).to(tl.int64)
    cols = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok, col_ok = rows < end, cols < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for r0 in range(0, R, BLOCK_R):
        r = r0 + tl.arange(0, BLOCK_R)
        r_ok = r < R
        y = tl.load(y_ptr + rows[:, None] * R + r[None, :],
                    mask=row_ok[:, None] & r_ok[None, :], other=0.0)  # fmt: skip
        b = tl.load(b_ptr + slot * R * N + r[:, None] * N + cols[None, :],
                    mask=r_ok[:, None] & col_ok[None, :], other=0.0)  # fmt: skip
        acc += tl.dot(y, b.to(tl.float32), input_precision="ieee")
    tl.store(out_ptr + rows[:, None] * N + cols[None, :], acc,
             mask=row_ok[:, None] & col_ok[None, :])  # fmt: skip


def _block_r(rank: int) -> int:
    return max(16, triton.next_power_of_2(rank))  # tl.dot's least size


def sgmv_shrink(
    x: torch.Tensor,
    a: torch.Tensor,
    lora_grouped_offsets: torch.Tensor,
    lora_ids: torch.Tensor,
    max_group_len: int,
) -> torch.Tensor:
    """[T, R] float32: each token times its group's adapter's ``A``; zeros without one."""
    x, a = x.contiguous(), a.contiguous()
    num_slots, rank, k = a.shape
    y = torch.zeros(x.shape[0], rank, dtype=torch.float32, device=x.device)
    num_groups = lora_ids.numel()
    if num_groups and max_group_len and rank and num_slots:
        grid = (num_groups, triton.cdiv(max_group_len, BLOCK_M))
        _shrink_kernel[grid](
            x, a, y, lora_grouped_offsets, lora_ids, num_slots, k, rank,
            BLOCK_M=BLOCK_M, BLOCK_R=_block_r(rank), BLOCK_K=BLOCK_K,
        )  # fmt: skip
    return y


def sgmv_expand(
    y: torch.Tensor,
    b: torch.Tensor,
    lora_grouped_offsets: torch.Tensor,
    lora_ids: torch.Tensor,
    max_group_len: int,
) -> torch.Tensor:
    """[T, out] float32: each token's shrunk row times its group's adapter's scaled
    ``B``; zeros without one."""
    y, b = y.contiguous(), b.contiguous()
    num_slots, rank, n = b.shape
    out = torch.zeros(y.shape[0], n, dtype=torch.float32, device=y.device)
    num_groups = lora_ids.numel()
    if num_groups and max_group_len and rank and num_slots:
        grid = (num_groups, triton.cdiv(max_group_len, BLOCK_M), triton.cdiv(n, BLOCK_N))
        _expand_kernel[grid](
            y, b, out, lora_grouped_offsets, lora_ids, num_slots, rank, n,
            BLOCK_M=BLOCK_M, BLOCK_R=min(_block_r(rank), 64), BLOCK_N=BLOCK_N,
        )  # fmt: skip
    return out
