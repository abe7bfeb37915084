"""bf16 products on AVX2 and AVX512-BF16 CPUs: ``bf16_linear.cpp`` (built by ``extension``).

aten's bf16 GEMM for few rows converts the weight to fp32 once per row, so a 6-row verify
step costs about six 1-row steps. The kernel here reads each weight element once per
call, whatever the row count, from a copy of the weight packed in 16-column panels
(``pack``). On AVX2 it converts each element to fp32 and multiplies with FMAs; where the
CPU has AVX512-BF16 (``dot_supported``) the panels hold pairs of k for ``vdpbf16ps``,
which does four times the multiply-adds per instruction with no conversion.

Measured at SmolLM2-135M shapes (``python -m kernels.cpu.bf16_gemm``, weights cache-hot),
one forward's products on a 2-core EPYC with AVX512-BF16, in ms:

| rows | aten bf16 | AVX2 layout | bf16-dot layout |
|---:|---:|---:|---:|
| 1 | 15.5 | 5.05 | 3.54 |
| 4 | 16.4 | 9.00 | 5.12 |
| 8 | 17.5 | 22.8 | 8.04 |
| 32 | 31.9 | 55.5 | 25.2 |

With weights streamed from memory, as in a model's forward, the bf16-dot layout reads
about 30 GB/s up to 6 rows there (4 rows cost what 1 does), where the AVX2 layout falls
to 15 GB/s at 6 rows: its FMAs, not memory, bound it past 2 rows.

Built with the other CPU kernels (``kernels/cpu/extension.py``).
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch

from kernels.cpu.extension import available
from kernels.cpu.timing import best_ms

__all__ = ["PANEL", "available", "dot_supported", "linear", "pack"]

PANEL = 16  # output features per panel: panels[i] holds weight rows 16 i .. 16 i + 15


DOT_ENV = "TANDEM_CPU_BF16_DOT"  # "0": pack in the AVX2 layout even where AVX512-BF16 runs


def dot_supported() -> bool:
    """Whether this CPU has AVX512-BF16, the faster of the two panel layouts (and
    ``TANDEM_CPU_BF16_DOT`` does not turn it off)."""
    if os.environ.get(DOT_ENV, "1") == "0":
        return False
    return available() and bool(torch.ops.tandem_cpu.bf16_dot_supported())


def pack(weight: torch.Tensor, dot: bool | None = None) -> torch.Tensor:
    """[N, K] bf16 -> panels of ``PANEL`` output features for ``linear``: [ceil(N/16), K, 16]
    (AVX2), or with ``dot`` [ceil(N/16), K/2, 32] (AVX512-BF16 pairs of k; K even). ``dot``
    None takes the faster layout this CPU runs. Rows from a multiple of ``PANEL`` on are a
    slice of panels: ``pack(w)[r // PANEL:]`` is ``pack(w[r:])``."""
    if not available():
        raise RuntimeError(
            "bf16_gemm.pack: the CPU kernels are not built here (see the warning logged by "
            "kernels.cpu.extension); keep the plain weight"
        )
    if dot is None:
        dot = dot_supported() and weight.shape[-1] % 2 == 0
    packed: torch.Tensor = torch.ops.tandem_cpu.pack_bf16(weight.detach().contiguous(), dot)
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

    layouts = [False, True] if dot_supported() else [False]

    def products(rows: int, n: int, k: int) -> list[Callable[[], object]]:
        """aten bf16, oneDNN on a packed fp32 copy, this kernel per layout: one product each."""
        w = torch.randn(n, k).bfloat16()
        w32 = torch.ops.mkldnn._reorder_linear_weight(w.float(), rows)
        panels = [pack(w, dot) for dot in layouts]
        x = torch.randn(rows, k).bfloat16()
        return [
            lambda: F.linear(x, w),
            lambda: torch.ops.mkldnn._linear_pointwise(x.float(), w32, None, "none", [], ""),
            *[lambda p=p: linear(x, p, None, n) for p in panels],
        ]

    # (out, in, how many per forward) of SmolLM2-135M's products: 30 layers, then the lm_head
    shapes = [(960, 576, 30), (576, 576, 30), (3072, 576, 30), (576, 1536, 30), (49152, 576, 1)]
    names = ["aten bf16", "packed fp32", "kernel avx2", "kernel bf16-dot"][: 2 + len(layouts)]
    print("one forward's products, ms:")
    print(f"{'rows':>5} " + " ".join(f"{name:>15}" for name in names))
    for rows in args.rows:
        totals = [0.0] * len(names)
        for n, k, count in shapes:
            for i, fn in enumerate(products(rows, n, k)):
                totals[i] += count * best_ms(fn)
        print(f"{rows:>5} " + " ".join(f"{t:>15.2f}" for t in totals))


if __name__ == "__main__":
    _benchmark()
