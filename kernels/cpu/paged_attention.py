"""Decode and verification attention straight from the paged KV cache on AVX2 CPUs:
``paged_attention.cpp``, built with the other CPU kernels (``kernels/cpu/extension.py``).

``python -m kernels.cpu.paged_attention`` times it against the plain-torch path (gather,
fp32 casts, masked SDPA) at SmolLM2-135M's attention shapes.
"""

from __future__ import annotations

import torch

from kernels.cpu.extension import available
from kernels.cpu.timing import best_ms

__all__ = ["attention", "available"]


def attention(
    q: torch.Tensor,  # [T, Hq, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D], q's dtype
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, M] int64
    context_lens: torch.Tensor,  # [B] int64: KV length of each row, this step's K/V written
    row_offsets: torch.Tensor,  # [B + 1] int64
    positions: torch.Tensor,  # [T] int64
    scale: float,
    is_causal: bool,
) -> torch.Tensor:
    """[T, Hq, D]: each token attends to its row's context (causal: up to its position)."""
    out: torch.Tensor = torch.ops.tandem_cpu.paged_attention(
        q, k_cache, v_cache, block_tables, context_lens, row_offsets, positions, scale, is_causal
    )
    return out


def _benchmark() -> None:
    """Times one layer's decode attention: the kernel against gather + SDPA."""
    import argparse

    import torch.nn.functional as F

    parser = argparse.ArgumentParser(
        description="Time the paged-attention kernel against the plain-torch path (gather "
        "the rows' K/V, cast to fp32, masked SDPA) for one layer at SmolLM2-135M's heads."
    )
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32, 64])
    parser.add_argument("--context", type=int, default=256, help="KV length of every row")
    parser.add_argument("--query", type=int, default=1, help="tokens per row (K+1 to verify)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if not available():
        raise SystemExit("the kernel is not available here (see the warning above)")
    hq, hkv, d, bs = 9, 3, 64, 16

    def one_layer(b: int) -> tuple[float, float]:
        """(gather + SDPA, kernel) ms for ``b`` rows."""
        per_row = -(-args.context // bs)
        cache = torch.randn(2, b * per_row, bs, hkv, d).bfloat16()
        tables = torch.randperm(b * per_row).view(b, per_row)
        lens = torch.full((b,), args.context)
        n = args.query
        q = torch.randn(b * n, hq, d).bfloat16()
        positions = torch.arange(args.context - n, args.context).repeat(b)
        offsets = torch.arange(b + 1) * n
        ctx = torch.arange(args.context)
        slots = tables[:, ctx // bs] * bs + ctx % bs
        mask = (ctx[None, None, :] <= positions.view(b, n)[:, :, None]).unsqueeze(1)

        def plain() -> torch.Tensor:
            k = cache[0].view(-1, hkv, d)[slots].transpose(1, 2).float()
            v = cache[1].view(-1, hkv, d)[slots].transpose(1, 2).float()
            qp = q.view(b, n, hq, d).transpose(1, 2).float()
            out = F.scaled_dot_product_attention(qp, k, v, attn_mask=mask, enable_gqa=True)
            return out.bfloat16()

        def kernel() -> torch.Tensor:
            return attention(q, cache[0], cache[1], tables, lens, offsets, positions, d**-0.5, True)

        return best_ms(plain), best_ms(kernel)

    print(f"one layer's attention, ms ({args.query} query tokens, {args.context} context):")
    print(f"{'rows':>5} {'gather+SDPA':>12} {'kernel':>8}")
    for b in args.rows:
        plain_ms, kernel_ms = one_layer(b)
        print(f"{b:>5} {plain_ms:>12.2f} {kernel_ms:>8.2f}")


if __name__ == "__main__":
    _benchmark()
