"""Building blocks shared by the Llama-family models, numerically aligned with transformers."""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.fx.experimental.symbolic_shapes import statically_known_true

from engine.config import Llama3RopeScaling
from engine.fp8 import Fp8Linear
from engine.parallel.group import TensorParallelGroup
from kernels.cpu import bf16_gemm, gemm_timings, onednn_linear
from kernels.cpu.gemm_plan import ATEN, KERNEL, ONEDNN, GemmPlan, planned_linear, run_product
from kernels.cpu.onednn_linear import OneDnnWeight

logger = logging.getLogger(__name__)


class RMSNorm(nn.Module):
    """RMSNorm computed in fp32 and cast back, as transformers does."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.rms_norm(x.float(), self.weight.shape, eps=self.eps)
        return self.weight * h.to(x.dtype)


def rope_inv_freq(head_dim: int, theta: float, scaling: Llama3RopeScaling | None) -> torch.Tensor:
    """Inverse frequencies [head_dim // 2], with the llama3 frequency-dependent scaling."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling is None:
        return inv_freq
    low_wavelen = scaling.original_max_position_embeddings / scaling.low_freq_factor
    high_wavelen = scaling.original_max_position_embeddings / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (scaling.original_max_position_embeddings / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    is_medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """Precomputed cos/sin tables [max_positions, head_dim] in the model dtype.

    ``lookup`` runs once per forward; ``rotate`` turns queries and keys of every layer.
    The sine table is stored with the sign of ``rotate_half`` folded in, so a rotation is
    ``x * cos + swap_halves(x) * signed_sin``: the same products transformers computes.
    """

    def __init__(
        self,
        head_dim: int,
        max_positions: int,
        theta: float,
        scaling: Llama3RopeScaling | None,
        dtype: torch.dtype,
    ) -> None:
        super().__init__()
        self.head_dim, self.max_positions = head_dim, max_positions
        self.theta, self.scaling, self.dtype = theta, scaling, dtype
        self.cos: torch.Tensor
        self.sin: torch.Tensor
        self.register_buffer("cos", torch.empty(0), persistent=False)
        self.register_buffer("sin", torch.empty(0), persistent=False)
        self.reset_buffers(torch.empty(0).device)

    def reset_buffers(self, device: torch.device) -> None:
        if device.type == "meta":  # shapes only, for tracing the step without data
            shape = (self.max_positions, self.head_dim)
            self.cos = torch.empty(shape, dtype=self.dtype, device=device)
            self.sin = torch.empty(shape, dtype=self.dtype, device=device)
            return
        inv_freq, factor = self.inv_freq()
        positions = torch.arange(self.max_positions, dtype=torch.float32)
        freqs = positions[:, None] * inv_freq[None, :]  # [P, D/2], fp32 as in transformers
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos(), emb.sin()
        if factor != 1.0:
            cos, sin = cos * factor, sin * factor
        half = self.head_dim // 2
        sin[:, :half] = -sin[:, :half]
        self.cos = cos.to(device=device, dtype=self.dtype)
        self.sin = sin.to(device=device, dtype=self.dtype)

    def inv_freq(self) -> tuple[torch.Tensor, float]:
        """Inverse frequencies [head_dim // 2], and the factor cos and sin are scaled by."""
        return rope_inv_freq(self.head_dim, self.theta, self.scaling), 1.0

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin for each token: ([T, 1, D], [T, 1, D])."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)

    @staticmethod
    def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotates ``x`` [T, H, D]; queries and keys may be rotated together."""
        t, h, d = x.shape
        swapped = x.view(t, h, 2, d // 2).flip(2).view(t, h, d)  # [x2, x1]
        return x * cos + swapped * sin


class Linear(nn.Linear):
    """``nn.Linear`` whose CPU products follow a plan per row count (``use_packed_gemm``).

    Three products compute it, each from its own layout of the weight: the bf16 kernel
    (``kernels.cpu.bf16_gemm``, bf16 weights packed in 16-column panels; it reads each
    weight element once per call, so a few rows cost about what one does), aten's
    ``F.linear`` on the weight as it is, and oneDNN on a blocked copy (bf16 where oneDNN
    runs bf16 here, with AMX tiles where the CPU has them; else an fp32 copy, twice a bf16
    weight's memory). Their costs grow differently with the rows, so a ``GemmPlan`` per
    weight shape names the fastest per row bucket, from timings taken once per machine
    (``kernels.cpu.gemm_timings``). Only the layouts a plan uses are made, and the native
    weight is released where no bucket uses aten (``release_packed_weights``).

    Compiled graphs fix one row and leave more as a symbol: a plan with one product from
    2 rows on calls it directly; a plan that changes product past 2 rows chooses when
    the op runs (``tandem::planned_linear``), so that row counts add no graphs.
    """

    _plan: GemmPlan | None = None  # set by use_packed_gemm; None: aten on the native weight
    _panels: torch.Tensor | None = None  # the bf16 kernel's layout, where the plan uses it
    _onednn: OneDnnWeight | None = None  # oneDNN's blocked copy, where the plan uses it

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        plan = self._plan
        if plan is None:
            return F.linear(x, self.weight, self.bias)
        product = self._product_for(x)
        if product is None:  # compiled, and the product changes past 2 rows
            return planned_linear(
                x, plan, self.weight, self.bias, self._panels, self._onednn, self.out_features
            )
        return self._product(product, x)

    def _product_for(self, x: torch.Tensor) -> str | None:
        """The plan's product for x's rows; None where only the op can choose it. Compiled
        graphs fix one row and leave more as a symbol: no branch on it (a guard each)."""
        assert self._plan is not None
        rows = x.numel() // x.shape[-1]
        if not torch.compiler.is_compiling():
            return self._plan.product(rows)
        if statically_known_true(rows == 1):
            return self._plan.products[0]
        return self._plan.from_two

    def _product(self, product: str, x: torch.Tensor) -> torch.Tensor:
        return run_product(
            product, x, self.weight, self.bias, self._panels, self._onednn, self.out_features
        )

    def prepare(self, plan: GemmPlan) -> None:
        """Makes the layouts ``plan`` uses (a plan of aten alone needs none)."""
        self._plan = None if plan == GemmPlan.uniform(ATEN) else plan
        self._panels = bf16_gemm.pack(self.weight) if plan.uses(KERNEL) else None
        self._onednn = None
        if plan.uses(ONEDNN):
            self._onednn = onednn_linear.pack(self.weight, self.bias)
            if self._onednn is None:
                raise RuntimeError(f"oneDNN cannot pack a {self.weight.dtype} weight here")

    def forward_rows(self, x: torch.Tensor, start: int) -> torch.Tensor:
        """The output features from ``start`` on: ``x @ weight[start:].T + bias[start:]``
        (DFlash's context K/V from a fused qkv projection), also once the native weight
        was released (``release_packed_weights``)."""
        bias = None if self.bias is None else self.bias[start:]
        product = ATEN if self._plan is None else self._product_for(x)
        if product == ATEN:
            return F.linear(x, self.weight[start:], bias)
        if product == KERNEL and start % bf16_gemm.PANEL == 0:
            assert self._panels is not None
            panels = self._panels[start // bf16_gemm.PANEL :]
            return bf16_gemm.linear(x, panels, bias, self.out_features - start)
        return self(x)[..., start:]


PRODUCT_CHOICES = ("measured", KERNEL, ATEN, ONEDNN)


def use_packed_gemm(model: nn.Module, products: str = "measured") -> None:
    """Prepares every ``Linear`` of an inference model for fast CPU products (see ``Linear``).

    ``products``: "measured" plans each weight shape from this machine's timings (timed
    now where not cached: about a second for SmolLM2); a product's name runs it
    everywhere it can (aten where it cannot: the kernel takes bf16 weights only). Packs
    now (about 2 s for SmolLM2), so that the first request does not pay for it. The
    packed copies are not updated if the weights change afterwards.
    """
    if products not in PRODUCT_CHOICES:
        raise ValueError(f"products: one of {PRODUCT_CHOICES}, got {products!r}")
    linears = [m for m in model.modules() if isinstance(m, Linear) and m.weight.numel() > 0]
    shapes = {(m.out_features, m.in_features, m.weight.dtype) for m in linears}
    if products == "measured":
        plans = gemm_timings.plans(shapes)
    else:
        plans = {
            shape: GemmPlan.uniform(
                products if products in gemm_timings.candidates(shape[2]) else ATEN
            )
            for shape in shapes
        }
    layout_bytes = {KERNEL: 0, ONEDNN: 0}
    for module in linears:
        module.prepare(plans[module.out_features, module.in_features, module.weight.dtype])
        if module._panels is not None:
            layout_bytes[KERNEL] += module._panels.numel() * module._panels.element_size()
        if module._onednn is not None:
            layout_bytes[ONEDNN] += module._onednn.nbytes
    logger.info(
        "packed weights: %.0f MB of kernel panels, %.0f MB of oneDNN copies",
        layout_bytes[KERNEL] / 1e6,
        layout_bytes[ONEDNN] / 1e6,
    )


def release_packed_weights(*models: nn.Module) -> int:
    """Frees the native weight of every ``Linear`` whose plan never uses aten, unless
    another parameter slot shares it (a tied lm_head keeps the embedding's). Call once the
    target and its drafter are both packed. Returns the bytes freed: the other layouts
    hold the same values, so this halves the weights' memory where the kernel's panels,
    or a bf16 oneDNN copy, serve every row count."""
    uses: dict[int, int] = {}
    for model in models:
        for _, param in model.named_parameters(remove_duplicate=False):
            uses[id(param)] = uses.get(id(param), 0) + 1
    freed = 0
    for model in models:
        for module in model.modules():
            if not isinstance(module, Linear) or module._plan is None:
                continue
            weight = module.weight
            if module._plan.uses(ATEN) or uses.get(id(weight), 0) != 1 or weight.numel() == 0:
                continue
            freed += weight.numel() * weight.element_size()
            # An empty stand-in keeps the attribute (and the dtype) for code that looks.
            module.weight = nn.Parameter(weight.new_empty(0), requires_grad=False)
    if freed:
        _trim_heap()
    return freed


def _trim_heap() -> None:
    """Gives freed heap memory back to the system. glibc keeps it otherwise: after large
    frees its mmap threshold rises, so the weights were on the heap. Measured with a bf16
    SmolLM2 engine, which frees 212 MB here: RSS 1029 MB before, 968 MB after the release
    without this, 783 MB with it."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: its allocator does as it does
        pass


class GatedMLP(nn.Module):
    """SwiGLU MLP with gate and up projections fused into one matrix."""

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        bias: bool,
        tp: TensorParallelGroup | None = None,
    ) -> None:
        """``tp``: this rank's share of the intermediate channels; down_proj's partial sums
        are all-reduced, its bias added by rank 0."""
        super().__init__()
        self.tp = tp
        shard_inter = intermediate_size
        if tp is not None:
            shard_inter = len(tp.shard.even(intermediate_size, "intermediate_size"))
        self.intermediate_size = shard_inter
        self.gate_up_proj = Linear(hidden_size, 2 * shard_inter, bias=bias)
        down_bias = bias and (tp is None or tp.shard.rank == 0)
        self.down_proj = Linear(shard_inter, hidden_size, bias=down_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        out = self.down_proj(F.silu(gate) * up)
        return out if self.tp is None else self.tp.all_reduce(out)


def dequantize_fp8(model: nn.Module, dtype: torch.dtype) -> int:
    """Replaces every ``Fp8Linear`` with an engine ``Linear`` of its weight in ``dtype``
    (what the packed CPU kernels run); returns how many."""
    swapped = 0
    for name, module in list(model.named_modules()):
        if not isinstance(module, Fp8Linear):
            continue
        parent_path, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_path) if parent_path else model
        with torch.device("meta"):
            linear = Linear(module.in_features, module.out_features, bias=module.bias is not None)
        linear.weight = nn.Parameter(module.dequantized(dtype), requires_grad=False)
        if module.bias is not None:
            linear.bias = module.bias
        setattr(parent, attr, linear)
        swapped += 1
    return swapped
