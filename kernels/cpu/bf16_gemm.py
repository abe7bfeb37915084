"""bf16 products on AVX2 CPUs: ``bf16_linear.cpp``, built on first use.

CPUs without native bf16 dot products (AVX2, no AVX512-BF16/AMX) make aten's bf16 GEMM
convert the weight to fp32 once per row, so a 6-row verify step costs about six 1-row
steps. The kernel here reads and converts each weight element once per call, whatever the
row count, from a copy of the weight packed in 16-column panels (``pack``): a few rows
cost about what one does, and many rows (prefill) run like an fp32 GEMM. Measured at
SmolLM2-135M shapes on a 2-core EPYC (``python -m kernels.cpu.bf16_gemm``), one forward's
products at 1 row take half aten's time, and at 6 rows about a sixth.

Built with the other CPU kernels (``kernels/cpu/extension.py``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from kernels.cpu.extension import available
from kernels.cpu.timing import best_ms

__all__ = ["PANEL", "available", "linear", "pack"]

PANEL = 16  # output features per panel: panels[i] holds weight rows 16 i .. 16 i + 15


def pack(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] bf16 -> [ceil(N/16), K, 16] bf16 panels for ``linear``. Rows from a multiple
    of ``PANEL`` on are a slice of panels: ``pack(w)[r // PANEL:]`` is ``pack(w[r:])``."""
    packed: torch.Tensor = torch.ops.tandem_cpu.pack_bf16(weight.detach().contiguous())
    return packed


def linear(
    x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, out_features: int
) -> torch.Tensor:
    """``x @ weight.T + bias`` in x's dtype (bf16 or fp32), accumulated in fp32."""
    out: torch.Tensor = torch.ops.tandem_cpu.bf16_linear(x, packed, bias, out_features)
    return out


def _benchmark() -> None:
    """Times the kernel against aten at SmolLM2-135M shapes; prints one table."""
    import argparse

    import torch.nn.functional as F

    parser = argparse.ArgumentParser(
        description="Time the bf16 GEMM kernel against aten's bf16 and packed-fp32 products, "
        "at SmolLM2-135M's shapes, per forward of ROWS tokens."
    )
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 6, 8, 16, 32, 64])
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if not available():
        raise SystemExit("the kernel is not available here (see the warning above)")

    def products(rows: int, n: int, k: int) -> list[Callable[[], object]]:
        """aten bf16, oneDNN on a packed fp32 copy, this kernel: one product each."""
        w = torch.randn(n, k).bfloat16()
        w32 = torch.ops.mkldnn._reorder_linear_weight(w.float(), rows)
        panels = pack(w)
        x = torch.randn(rows, k).bfloat16()
        return [
            lambda: F.linear(x, w),
            lambda: torch.ops.mkldnn._linear_pointwise(x.float(), w32, None, "none", [], ""),
            lambda: linear(x, panels, None, n),
        ]

    # (out, in, how many per forward) of SmolLM2-135M's products: 30 layers, then the lm_head
    shapes = [(960, 576, 30), (576, 576, 30), (3072, 576, 30), (576, 1536, 30), (49152, 576, 1)]
    print("one forward's products, ms:")
    print(f"{'rows':>5} {'aten bf16':>10} {'packed fp32':>12} {'kernel':>8}")
    for rows in args.rows:
        totals = [0.0, 0.0, 0.0]
        for n, k, count in shapes:
            for i, fn in enumerate(products(rows, n, k)):
                totals[i] += count * best_ms(fn)
        print(f"{rows:>5} {totals[0]:>10.2f} {totals[1]:>12.2f} {totals[2]:>8.2f}")


if __name__ == "__main__":
    _benchmark()
