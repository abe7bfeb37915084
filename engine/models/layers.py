"""Building blocks shared by the Llama-family models, numerically aligned with transformers."""

from __future__ import annotations

import ctypes
import ctypes.util
import math

import torch
import torch.nn.functional as F
from torch import nn

from engine.config import Llama3RopeScaling
from kernels.cpu import bf16_gemm


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
    """``nn.Linear`` with CPU products prepared for decode and verify steps (``use_packed_gemm``).

    CPUs without native bf16 dot products (AVX2) make aten's bf16 GEMM convert the weight
    once per row, so a product of M rows costs about M matrix-vector products. Two remedies:

    - bf16 weights, when ``kernels.cpu.bf16_gemm`` is built: every product runs on it,
      from a copy of the weight packed in 16-column panels. It reads each weight element
      once per call, so 6 rows cost about what 2 do (AVX2) or 1 does (AVX512-BF16), and 1
      row half of aten's time.
    - otherwise, from ``packed_min_rows`` rows on, the product runs on an fp32 copy of the
      weight in oneDNN's blocked layout, about 1.8x aten's sgemm for few rows (what a bf16
      GEMM accumulates in anyway, rounded back to bf16). It costs twice a bf16 weight's
      memory (one more fp32 weight when serving fp32); matrix-vector products keep the
      native weight.
    """

    packed_min_rows: int = 0  # set with _fp32 by use_packed_gemm
    _fp32: _PackedFp32Linear | None = None
    _panels: torch.Tensor | None = None  # set by use_packed_gemm: the bf16 kernel's layout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._panels is not None:
            return bf16_gemm.linear(x, self._panels, self.bias, self.out_features)
        if self._fp32 is None or x.shape[0] < self.packed_min_rows:
            return F.linear(x, self.weight, self.bias)
        return self._fp32(x.float()).to(x.dtype)

    def forward_rows(self, x: torch.Tensor, start: int) -> torch.Tensor:
        """The output features from ``start`` on: ``x @ weight[start:].T + bias[start:]``
        (DFlash's context K/V from a fused qkv projection), also once the native weight
        was released (``release_packed_weights``)."""
        bias = None if self.bias is None else self.bias[start:]
        if self._panels is None:
            return F.linear(x, self.weight[start:], bias)
        if start % bf16_gemm.PANEL == 0:
            panels = self._panels[start // bf16_gemm.PANEL :]
            return bf16_gemm.linear(x, panels, bias, self.out_features - start)
        return self(x)[..., start:]


class _PackedFp32Linear:
    """An fp32 copy of a weight, in oneDNN's blocked layout when oneDNN can pack it."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, is_packed: bool) -> None:
        self.weight, self.bias, self.is_packed = weight, bias, is_packed

    @classmethod
    def create(cls, weight: torch.Tensor, bias: torch.Tensor | None) -> _PackedFp32Linear | None:
        """None when it would only duplicate the weight: fp32 already and no oneDNN packing."""
        w32 = weight.detach().float()
        b32 = None if bias is None else bias.detach().float()
        if torch.backends.mkldnn.is_available():
            try:
                return cls(torch.ops.mkldnn._reorder_linear_weight(w32, 8), b32, is_packed=True)
            except RuntimeError:
                pass
        if weight.dtype == torch.float32:
            return None
        return cls(w32, b32, is_packed=False)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.is_packed:
            return packed_fp32_linear(x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)


@torch.library.custom_op("tandem::packed_fp32_linear", mutates_args=())
def packed_fp32_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """``x @ weight.T + bias`` with ``weight`` in oneDNN's blocked layout. An opaque op, so
    that torch.compile calls it as it is (inductor's own lowering of the oneDNN op expects
    weights it packed itself)."""
    out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return out


@packed_fp32_linear.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


def use_packed_gemm(model: nn.Module, min_rows: int) -> None:
    """Prepares every ``Linear`` of an inference model for fast CPU products (see ``Linear``).

    bf16 weights go to the bf16 kernel when it is available (it builds on first
    use); other weights run products of at least ``min_rows`` rows on packed fp32 copies.
    Packs now (about 2 s for SmolLM2), so that the first request does not pay for it. The
    packed copies are not updated if the weights change afterwards.
    """
    for module in model.modules():
        if not isinstance(module, Linear):
            continue
        if module.weight.dtype == torch.bfloat16 and bf16_gemm.available():
            module._panels = bf16_gemm.pack(module.weight)
            continue
        module.packed_min_rows = min_rows
        module._fp32 = _PackedFp32Linear.create(module.weight, module.bias)


def release_packed_weights(*models: nn.Module) -> int:
    """Frees the native weight of every ``Linear`` whose products all run on the bf16
    kernel's panels, unless another parameter slot shares it (a tied lm_head keeps the
    embedding's). Call once the target and its drafter are both packed. Returns the bytes
    freed: the panels hold the same bf16 values, so this halves the weights' memory."""
    uses: dict[int, int] = {}
    for model in models:
        for _, param in model.named_parameters(remove_duplicate=False):
            uses[id(param)] = uses.get(id(param), 0) + 1
    freed = 0
    for model in models:
        for module in model.modules():
            if not isinstance(module, Linear) or module._panels is None:
                continue
            weight = module.weight
            if uses.get(id(weight), 0) != 1 or weight.numel() == 0:
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

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool) -> None:
        super().__init__()
        self.intermediate_size = intermediate_size
        self.gate_up_proj = Linear(hidden_size, 2 * intermediate_size, bias=bias)
        self.down_proj = Linear(intermediate_size, hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        return self.down_proj(F.silu(gate) * up)
