"""Products on a copy of a weight in oneDNN's blocked layout (``torch.ops.mkldnn``).

A bf16 weight stays bf16 where oneDNN runs bf16 on this CPU (AVX512-BF16, or AMX tiles on
the Xeons that have them); other weights, and bf16 ones where oneDNN has no bf16, are
copied to fp32, which costs twice a bf16 weight's memory. Inside compiled graphs the
product is an opaque op (``tandem::onednn_linear``): inductor's own lowering of the oneDNN
op expects weights it packed itself.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["OneDnnWeight", "available", "linear", "pack"]


def available() -> bool:
    return bool(torch.backends.mkldnn.is_available())


def layout_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of the blocked copy of a ``dtype`` weight."""
    if dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return torch.bfloat16
    return torch.float32


@dataclass
class OneDnnWeight:
    """A weight [N, K] in oneDNN's blocked layout, with its bias, both in ``dtype``."""

    weight: torch.Tensor
    bias: torch.Tensor | None
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return self.weight.numel() * self.weight.element_size()


def pack(weight: torch.Tensor, bias: torch.Tensor | None) -> OneDnnWeight | None:
    """The blocked copy, or None where oneDNN cannot pack it here."""
    if not available():
        return None
    dtype = layout_dtype(weight.dtype)
    try:
        # 8: the row count oneDNN picks its blocking for; products of any count run on it
        packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach().to(dtype), 8)
    except RuntimeError:
        return None
    return OneDnnWeight(packed, None if bias is None else bias.detach().to(dtype), dtype)


def linear(x: torch.Tensor, packed: OneDnnWeight) -> torch.Tensor:
    """``x @ weight.T + bias`` in x's dtype, computed in the layout's dtype."""
    x_in = x if x.dtype == packed.dtype else x.to(packed.dtype)
    if torch.compiler.is_compiling():
        out: torch.Tensor = torch.ops.tandem.onednn_linear(x_in, packed.weight, packed.bias)
    else:
        out = _linear(x_in, packed.weight, packed.bias)
    return out if out.dtype == x.dtype else out.to(x.dtype)


def _linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return out


# A plain library op (a Python kernel behind the dispatcher): about 3 us a call, where
# torch.library.custom_op's wrappers cost about 12.
_LIB = torch.library.Library("tandem", "FRAGMENT")
_LIB.define("onednn_linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor")
_LIB.impl("onednn_linear", _linear, "CompositeExplicitAutograd")


@torch.library.register_fake("tandem::onednn_linear")
def _(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], weight.shape[0]))
