"""Block-FP8 checkpoints (DeepSeek-V3's format, and many FP8 releases of other models):
``quantization_config.quant_method == "fp8"`` with ``weight_block_size`` ``[bn, bk]``.
Each quantized projection's ``weight`` is float8_e4m3fn, with a float32
``weight_scale_inv`` per ``bn x bk`` block (``ceil(rows / bn) x ceil(cols / bk)``): the
weight is ``fp8 * scale_inv``. The embedding, norms and LM head stay as they are.

``Fp8Linear`` keeps the weight in FP8, one byte an element, with its scales: half of
bf16's memory. Its scales are held per row (``[out, ceil(in / bk)]``), so that fused
projections (q/k/v, gate/up), whose parts each start a new block, and tensor-parallel
row splits need no alignment; a column split must fall on a block edge. A projection whose
weight its model reads itself (a plain ``nn.Linear``: DeepSeek-V3's ``kv_b_proj``, which
its latent attention absorbs) is dequantized at load time.

On CPU a product dequantizes the weight on the fly (``Fp8Linear.forward``), or the model
is dequantized once at load time into bf16 ``Linear``s that the packed kernels run
(``engine.models.layers.dequantize_fp8``): EngineConfig.fp8_weights says which
(bench/RESULTS.md measures both).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from engine.weights import CheckpointReader, Part, TensorRule, WeightError, check_source
from kernels.cpu import extension as cpu_kernels

FP8 = torch.float8_e4m3fn
SCALE_SUFFIX = "_scale_inv"  # weight -> weight_scale_inv
FP8_MAX = 448.0  # float8_e4m3fn's largest finite value


class QuantizationError(ValueError):
    """A quantization_config Tandem cannot run; the message names the field."""


@dataclass(frozen=True)
class BlockFp8:
    """``weight_block_size``: rows and columns of one scale's block."""

    block_n: int
    block_k: int

    @classmethod
    def from_hf(cls, config: dict[str, Any] | None) -> BlockFp8 | None:
        """None without a quantization_config; raises QuantizationError, naming the field,
        for one that is not block FP8 as DeepSeek-V3 releases it."""
        if not config:
            return None
        method = config.get("quant_method")
        if method != "fp8":
            raise QuantizationError(
                f"quantization_config.quant_method: {method!r} is not supported; allowed: "
                "['fp8'] (block FP8 with weight_block_size)"
            )
        fmt = config.get("fmt", "e4m3")
        if fmt != "e4m3":
            raise QuantizationError(
                f"quantization_config.fmt: {fmt!r} is not supported; allowed: ['e4m3']"
            )
        scheme = config.get("activation_scheme", "dynamic")
        if scheme != "dynamic":
            raise QuantizationError(
                f"quantization_config.activation_scheme: {scheme!r} is not supported; "
                "allowed: ['dynamic'] (activations quantized per token as they come)"
            )
        block = config.get("weight_block_size")
        if (
            not isinstance(block, list)
            or len(block) != 2
            or not all(isinstance(b, int) and b > 0 and b % 16 == 0 for b in block)
        ):
            raise QuantizationError(
                f"quantization_config.weight_block_size: {block!r}; expected [rows, columns], "
                "each a positive multiple of 16 (per-tensor FP8 is not supported)"
            )
        return cls(block[0], block[1])


def dequantize(
    weight: torch.Tensor, scale: torch.Tensor, block_k: int, dtype: torch.dtype
) -> torch.Tensor:
    """``weight`` [N, K] float8_e4m3fn in ``dtype``: each element times its row's scale for
    its block of ``block_k`` columns (``scale`` [N, ceil(K / block_k)]) in fp32, rounded
    once. On CPU through ``kernels/cpu/fp8_dequant.cpp``, 8 lanes at a time: torch's own
    float8 conversion ran at about 200 M elements a second here (bench/RESULTS.md)."""
    if (
        weight.device.type == "cpu"
        and dtype in (torch.bfloat16, torch.float32)
        and weight.shape[1] % 8 == 0
        and cpu_kernels.available()
    ):
        out: torch.Tensor = torch.ops.tandem_cpu.fp8_dequant(weight, scale, block_k, dtype)
        return out
    expanded = scale.repeat_interleave(block_k, dim=1)[:, : weight.shape[1]]
    return (weight.to(torch.float32) * expanded).to(dtype)


class Fp8Linear(nn.Module):
    """A projection whose weight stays float8_e4m3fn, with its block scales per row."""

    def __init__(
        self, in_features: int, out_features: int, block: BlockFp8, bias: nn.Parameter | None
    ) -> None:
        super().__init__()
        self.in_features, self.out_features, self.block = in_features, out_features, block
        self.weight: torch.Tensor
        self.scale: torch.Tensor
        self.register_buffer("weight", torch.empty(out_features, in_features, dtype=FP8))
        blocks = math.ceil(in_features / block.block_k)
        self.register_buffer("scale", torch.empty(out_features, blocks, dtype=torch.float32))
        self.bias = bias

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight in ``dtype`` (``dequantize``)."""
        return dequantize(self.weight, self.scale, self.block.block_k, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.dequantized(x.dtype), self.bias)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"block={self.block.block_n}x{self.block.block_k}, bias={self.bias is not None}"
        )


def _module(model: nn.Module, dst: str, *, fp8: bool = False) -> tuple[nn.Module, str, Any]:
    """(parent, attribute, module) of the projection whose ``weight`` is ``dst`` (with
    ``fp8``, an ``Fp8Linear`` already swapped in is one too)."""
    path = dst.removesuffix(".weight")
    parent_path, _, attr = path.rpartition(".")
    try:
        parent = model.get_submodule(parent_path) if parent_path else model
        module = getattr(parent, attr)
    except AttributeError:
        raise WeightError(f"{dst}: adapter targets an unknown module") from None
    kinds = (nn.Linear, Fp8Linear) if fp8 else (nn.Linear,)
    if not isinstance(module, kinds):
        raise WeightError(f"{dst}: FP8 in the checkpoint, but {path} is no projection")
    return parent, attr, module


def quantized_rules(reader: CheckpointReader, rules: Sequence[TensorRule]) -> list[TensorRule]:
    """The weight rules whose sources the checkpoint holds in FP8 (each with its scale);
    raises WeightError, naming the tensor, for an FP8 weight without its scale or a rule
    that mixes FP8 and unquantized sources."""
    names = reader.names()
    found = []
    for rule in rules:
        if not rule.dst.endswith(".weight"):
            continue
        is_fp8 = [reader.dtype(src.name) == "F8_E4M3" for src in rule.sources]
        for src, fp8 in zip(rule.sources, is_fp8, strict=True):
            if fp8 and src.name + SCALE_SUFFIX not in names:
                raise WeightError(f"{src.name}: float8_e4m3fn without its {src.name}{SCALE_SUFFIX}")
        if any(is_fp8) and not all(is_fp8):
            plain = rule.sources[is_fp8.index(False)].name
            raise WeightError(f"{plain}: not FP8, but fused with FP8 tensors into {rule.dst}")
        if all(is_fp8):
            found.append(rule)
    return found


def _scale_rows(
    reader: CheckpointReader, name: str, shape: tuple[int, ...], part: Part | None, block: BlockFp8
) -> torch.Tensor:
    """``name``'s scales, one row per weight row (of ``part``'s rows or block columns)."""
    rows, cols = shape
    expected = (math.ceil(rows / block.block_n), math.ceil(cols / block.block_k))
    scale_name = name + SCALE_SUFFIX
    got = reader.shape(scale_name)
    if got != expected:
        raise WeightError(
            f"{scale_name}: shape {list(got)}, but {list(shape)} in blocks of "
            f"{block.block_n}x{block.block_k} needs {list(expected)}"
        )
    scale = reader.get(scale_name).to(torch.float32).repeat_interleave(block.block_n, dim=0)
    scale = scale[:rows]
    if part is None:
        return scale
    if part.dim == 0:
        return scale[part.start : part.stop]
    if part.start % block.block_k or (part.stop % block.block_k and part.stop != cols):
        raise WeightError(
            f"{name}: columns [{part.start}, {part.stop}) do not fall on its {block.block_k}-"
            "column blocks; use a tensor-parallel size whose split does"
        )
    return scale[:, part.start // block.block_k : math.ceil(part.stop / block.block_k)]


def swap_fp8(model: nn.Module, fp8: Sequence[TensorRule], block: BlockFp8) -> None:
    """On the meta device, before the model is materialised: an ``Fp8Linear`` in place of
    every projection ``fp8`` fills, so that no bf16 copy of it is ever allocated. A plain
    ``nn.Linear`` (a weight its model reads itself) stays, to be filled dequantized."""
    for rule in fp8:
        parent, attr, linear = _module(model, rule.dst)
        if type(linear) is nn.Linear:
            continue
        bias = linear.bias if isinstance(linear.bias, nn.Parameter) else None
        with torch.device("meta"):
            swapped = Fp8Linear(linear.in_features, linear.out_features, block, bias)
        setattr(parent, attr, swapped)


def fill_fp8(
    model: nn.Module, reader: CheckpointReader, fp8: Sequence[TensorRule], block: BlockFp8
) -> set[str]:
    """Fills what ``swap_fp8`` prepared, once the model is materialised: each
    ``Fp8Linear``'s FP8 weight and per-row scales, and each plain ``nn.Linear``'s weight
    dequantized. Returns the parameters filled (for ``load_weights``)."""
    filled: set[str] = set()
    for rule in fp8:
        _, _, module = _module(model, rule.dst, fp8=True)
        weights, scales = [], []
        for src in rule.sources:
            shape = check_source(reader, src)
            weights.append(reader.get(src.name, src.part))
            scales.append(_scale_rows(reader, src.name, shape, src.part, block))
        weight = torch.cat(weights) if len(weights) > 1 else weights[0]
        scale = torch.cat(scales) if len(scales) > 1 else scales[0]
        expected = (module.out_features, module.in_features)
        if tuple(weight.shape) != expected:
            raise WeightError(f"{rule.dst}: {list(weight.shape)}, the model's is {list(expected)}")
        with torch.no_grad():
            if isinstance(module, Fp8Linear):
                module.weight.copy_(weight)
                module.scale.copy_(scale)
            else:  # a weight the model reads itself (MLA's kv_b_proj): dequantized now
                module.weight.copy_(dequantize(weight, scale, block.block_k, module.weight.dtype))
                filled.add(rule.dst)
    return filled


def quantize_blocks(weight: torch.Tensor, block: BlockFp8) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8 weight, float32 scale_inv per block): how a block-FP8 checkpoint is made, each
    block scaled so that its largest magnitude maps to FP8_MAX (tests and tools)."""
    rows, cols = weight.shape
    nb, kb = math.ceil(rows / block.block_n), math.ceil(cols / block.block_k)
    padded = torch.zeros(nb * block.block_n, kb * block.block_k, dtype=torch.float32)
    padded[:rows, :cols] = weight.float()
    tiles = padded.view(nb, block.block_n, kb, block.block_k)
    amax = tiles.abs().amax(dim=(1, 3)).clamp(min=1e-12)  # [nb, kb]
    scale_inv = amax / FP8_MAX
    q = (tiles / scale_inv[:, None, :, None]).to(FP8).view(padded.shape)[:rows, :cols]
    return q.contiguous(), scale_inv
