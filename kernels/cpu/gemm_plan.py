"""Which product computes ``x @ weight.T + bias``, per row count: a plan per weight shape.

Three products: the bf16 kernel (``bf16_gemm``, bf16 weights only, from its panels),
aten's ``F.linear`` on the weight as it is, and oneDNN on its blocked copy
(``onednn_linear``; AMX tiles where the CPU has them). Their costs grow differently with
the rows (the kernel's about linearly, oneDNN's in steps), so which is fastest depends on
the CPU and the rows. A plan names one product per row bucket, chosen from timings
(``choose``; measured and cached per machine by ``kernels.cpu.gemm_timings``).
"""

from __future__ import annotations

import bisect
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernels.cpu import bf16_gemm, onednn_linear
from kernels.cpu.onednn_linear import OneDnnWeight

__all__ = ["ATEN", "BUCKETS", "KERNEL", "ONEDNN", "PRODUCTS", "GemmPlan", "choose", "run_product"]

KERNEL, ATEN, ONEDNN = "kernel", "aten", "onednn"
PRODUCTS = (KERNEL, ATEN, ONEDNN)
# A bucket serves row counts from its own up to the next one's. Powers of two: the
# crossovers seen lie between 1 and 8 rows and between 8 and 32 (issue 34), so each row
# count is within 2x of a timed one; from 256 rows on every product is bound by its
# multiply-adds and their order no longer changes (prefill chunks).
BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
# Another product takes over from the previous bucket's only when it is this much faster:
# timing noise does not flip plans, and each extra layout costs a copy of the weight (on
# AMX the issue measured oneDNN 2-5x faster from 32 rows; here 10-30 % from 16).
SWITCH_GAIN = 0.2

Timings = Mapping[int, Mapping[str, float]]  # bucket -> product -> time (any unit)


def bucket_index(rows: int) -> int:
    """The last bucket at or below ``rows`` (a loop: dynamo does not trace bisect)."""
    index = 0
    for i, bucket in enumerate(BUCKETS):
        if rows >= bucket:
            index = i
    return index


@dataclass(frozen=True)
class GemmPlan:
    """``products[i]`` serves the rows of ``BUCKETS[i]``."""

    products: tuple[str, ...]

    def __post_init__(self) -> None:
        if len(self.products) != len(BUCKETS) or not set(self.products) <= set(PRODUCTS):
            raise ValueError(f"a plan names one of {PRODUCTS} per bucket {BUCKETS}")

    @classmethod
    def uniform(cls, product: str) -> GemmPlan:
        return cls((product,) * len(BUCKETS))

    def product(self, rows: int) -> str:
        return self.products[bucket_index(rows)]

    def uses(self, product: str) -> bool:
        return product in self.products

    @property
    def from_two(self) -> str | None:
        """The product of every bucket from 2 rows on, where there is one."""
        rest = set(self.products[1:])
        return rest.pop() if len(rest) == 1 else None

    def segments(self) -> tuple[list[int], list[int]]:
        """(first rows, product codes) of each run of buckets with one product."""
        starts: list[int] = []
        codes: list[int] = []
        for bucket, product in zip(BUCKETS, self.products, strict=True):
            if not codes or PRODUCTS[codes[-1]] != product:
                starts.append(bucket)
                codes.append(PRODUCTS.index(product))
        return starts, codes

    def describe(self) -> str:
        """e.g. ``kernel 1-7, onednn 8+``."""
        starts, codes = self.segments()
        ends = [f"-{s - 1}" for s in starts[1:]] + ["+"]
        return ", ".join(
            f"{PRODUCTS[c]} {s}{'' if e == f'-{s}' else e}"
            for s, c, e in zip(starts, codes, ends, strict=True)
        )


def choose(timings: Timings, candidates: Sequence[str]) -> GemmPlan:
    """The fastest candidate per bucket. A bucket with no timings (past the time allowed
    to measure) keeps the previous bucket's product; the first bucket must be timed."""
    chosen: list[str] = []
    for bucket in BUCKETS:
        times = {p: t for p, t in timings.get(bucket, {}).items() if p in candidates}
        if not times:
            if not chosen:
                raise ValueError(f"no timings of {list(candidates)} at {bucket} row(s)")
            chosen.append(chosen[-1])
            continue
        best = min(times, key=times.__getitem__)
        previous = chosen[-1] if chosen else None
        if previous in times and times[previous] <= times[best] * (1 + SWITCH_GAIN):
            best = previous
        chosen.append(best)
    return GemmPlan(tuple(chosen))


def run_product(
    product: str,
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    panels: torch.Tensor | None,
    onednn: OneDnnWeight | None,
    out_features: int,
) -> torch.Tensor:
    """``x @ weight.T + bias`` on ``product``'s layout of the weight."""
    if product == KERNEL:
        assert panels is not None
        return bf16_gemm.linear(x, panels, bias, out_features)
    if product == ONEDNN:
        assert onednn is not None
        return onednn_linear.linear(x, onednn)
    return F.linear(x, weight, bias)


def planned_linear(
    x: torch.Tensor,
    plan: GemmPlan,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    panels: torch.Tensor | None,
    onednn: OneDnnWeight | None,
    out_features: int,
) -> torch.Tensor:
    """``plan``'s product for x's rows, chosen when the op runs: for compiled graphs, whose
    row counts are symbols (a branch on them in Python would add a graph per bucket)."""
    starts, codes = plan.segments()
    out: torch.Tensor = torch.ops.tandem.planned_linear(
        x,
        weight,
        bias,
        panels,
        None if onednn is None else onednn.weight,
        None if onednn is None else onednn.bias,
        out_features,
        starts,
        codes,
    )
    return out


def _planned_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    panels: torch.Tensor | None,
    onednn_weight: torch.Tensor | None,
    onednn_bias: torch.Tensor | None,
    out_features: int,
    starts: list[int],
    codes: list[int],
) -> torch.Tensor:
    rows = x.numel() // x.shape[-1]
    product = PRODUCTS[codes[max(bisect.bisect_right(starts, rows) - 1, 0)]]
    onednn = None
    if onednn_weight is not None:
        onednn = OneDnnWeight(onednn_weight, onednn_bias, onednn_weight.dtype)
    return run_product(product, x, weight, bias, panels, onednn, out_features)


# A plain library op, as tandem::onednn_linear (a few us a call)
_LIB = torch.library.Library("tandem", "FRAGMENT")
_LIB.define(
    "planned_linear(Tensor x, Tensor weight, Tensor? bias, Tensor? panels, "
    "Tensor? onednn_weight, Tensor? onednn_bias, int out_features, int[] starts, "
    "int[] codes) -> Tensor"
)
_LIB.impl("planned_linear", _planned_linear, "CompositeExplicitAutograd")


@torch.library.register_fake("tandem::planned_linear")
def _(x: torch.Tensor, *args: object) -> torch.Tensor:
    out_features = args[5]
    assert isinstance(out_features, int)
    return x.new_empty((*x.shape[:-1], out_features))
