"""GGUF files (llama.cpp's format) run as they are: read with the ``gguf`` package,
llama.cpp's own reader, and served in HF names as a ``CheckpointReader`` would.

In bf16, Q4_0, Q4_1 and Q8_0 projections stay quantized (``GgufLinear``): the file's
blocks, 16 rows side by side, run by ``kernels/cpu/gguf_linear.cpp`` (VNNI), or by
``reference_linear`` (dequantized, then aten: slow) where the CPU lacks AVX-512 VNNI. A
tied embedding shares its LM head's blocks (``GgufEmbedding``): resident weights stay
the file's size. F32, F16 and BF16 tensors load as safetensors ones do; every other type
(K-quants among them: llama.cpp writes LM heads in Q6_K) is dequantized at load time.
In float32 (the reference that transformers' own GGUF loader reproduces) and float16,
every tensor is dequantized at load time. A tensor the model has no place for (attention
biases the config does not declare, ...) is refused, naming it: the model would run
without it. Llama 3.1's rope scaling, which llama.cpp stores as a divisor per frequency
(``rope_freqs``), becomes the llama3 ``rope_parameters`` that give those divisors
(``fit_llama3_rope``), in the model directory's config.json and checked again at load.

llama.cpp stores Llama's q and k rows permuted for its rotary layout; they are put back
in HF's order here, row by row, on the quantized rows as they are.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType as QType
from torch import nn

from engine.config import Llama3RopeScaling
from engine.models.layers import rope_inv_freq
from engine.weights import Part, TensorRule, WeightError, check_source
from kernels.cpu import extension as cpu_kernels
from kernels.cpu.gguf_linear import (
    BLOCK,
    BLOCK_BYTES,
    ROWS,
    HugePageArena,
    dequantize_packed,
    kernel_runs,
    pack,
    reference_linear,
)

logger = logging.getLogger(__name__)

KEPT = (QType.Q4_0, QType.Q4_1, QType.Q8_0)  # run quantized (kernels.cpu.gguf_linear)
PLAIN = (QType.F32, QType.F16, QType.BF16)  # loaded as safetensors tensors are
# Every other type gguf can dequantize (the K-quants, IQ, Q5_0, ...) is dequantized at load
# time into the model's dtype: it runs, with bf16's memory for that tensor.
ARCHITECTURES = {"llama": "LlamaForCausalLM"}  # GGUF general.architecture -> HF's
# A GGUF model directory's weights, beside its config.json: engine.model_store writes it
# (which imports this module only when it needs torch; a test keeps the two names equal).
GGUF_NAME = "model.gguf"
ROPE_FREQS = "rope_freqs.weight"  # Llama 3.1+'s rope scaling: a divisor per frequency


def type_names(types: Sequence[QType]) -> str:
    return ", ".join(t.name for t in types)


def gguf_version() -> str:
    from importlib.metadata import version

    return version("gguf")


class GgufCheckpoint:
    """One GGUF file behind ``CheckpointReader``'s interface, in HF tensor names. Opening
    it refuses a file that is not GGUF or serves another architecture, naming the file;
    a tensor's errors name the tensor (``load_model`` adds the file)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        try:
            self.reader = gguf.GGUFReader(self.path)
        except Exception as exc:  # truncated, corrupt, not GGUF at all
            raise WeightError(f"{self.path.name}: not a readable GGUF file ({exc})") from None
        arch = self.field("general.architecture")
        if arch not in ARCHITECTURES:
            raise WeightError(
                f"{self.path.name}: general.architecture {arch!r} is not served; served: "
                f"{sorted(ARCHITECTURES)}"
            )
        self.arch = arch
        blocks = int(self.field(f"{arch}.block_count"))
        self.heads = int(self.field(f"{arch}.attention.head_count"))
        self.kv_heads = int(self.field(f"{arch}.attention.head_count_kv", self.heads))
        self.tensors = {t.name: t for t in self.reader.tensors}
        self.name_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, blocks)
        self.used: set[str] = set()  # the file's names of the tensors looked up

    def field(self, key: str, default: Any = None) -> Any:
        found = self.reader.get_field(key)
        if found is None:
            if default is None:
                raise WeightError(f"{self.path.name}: metadata {key} is missing")
            return default
        return found.contents()

    def _tensor(self, name: str) -> Any:
        file_name = self.name_map.get_name(name, try_suffixes=(".weight", ".bias"))
        if file_name is None or file_name not in self.tensors:
            raise WeightError(f"{name}: missing (as {file_name})")
        self.used.add(file_name)
        return self.tensors[file_name]

    def rope_scaling(self) -> Llama3RopeScaling | None:
        """Llama 3.1+'s rope scaling, which llama.cpp stores as a divisor per frequency
        (``rope_freqs.weight``): the llama3 parameters that give those divisors, or None
        without the tensor (or with divisors of 1). Raises WeightError, naming the tensor,
        for divisors that no llama3 parameters give."""
        tensor = self.tensors.get(ROPE_FREQS)
        if tensor is None:
            return None
        self.used.add(ROPE_FREQS)
        divisors = np.asarray(tensor.data, dtype=np.float32).reshape(-1)
        arch = self.arch
        width = int(self.field(f"{arch}.embedding_length"))
        head_dim = int(self.field(f"{arch}.rope.dimension_count", width // self.heads))
        theta = float(self.field(f"{arch}.rope.freq_base", 10000.0))
        if divisors.shape != (head_dim // 2,):
            raise WeightError(
                f"{ROPE_FREQS}: {divisors.size} divisors for {head_dim // 2} frequencies"
            )
        if np.all(divisors == 1.0):
            return None
        given = self.reader.get_field(f"{arch}.rope.scaling.original_context_length")
        scaling = fit_llama3_rope(
            divisors, head_dim, theta, int(given.contents()) if given is not None else None
        )
        if scaling is None:
            raise WeightError(
                f"{ROPE_FREQS}: divisors {divisors.round(4).tolist()} are not llama3 rope "
                "scaling's (factor, low and high frequency factors, original context)"
            )
        return scaling

    def unused(self) -> list[str]:
        """The file's tensors no lookup asked for: weights the model would run without."""
        return sorted(set(self.tensors) - self.used)

    def shape(self, name: str) -> tuple[int, ...]:
        """The HF shape: [rows, columns] (GGUF lists its dimensions the other way)."""
        return tuple(int(d) for d in reversed(self._tensor(name).shape))

    def qtype(self, name: str) -> QType:
        return QType(self._tensor(name).tensor_type)

    def dtype(self, name: str) -> str:
        return self.qtype(name).name

    def _rows(self, name: str) -> torch.Tensor | None:
        """HF row order of ``name`` from the file's, for Llama's q and k (weights and
        biases); else None."""
        heads = {"q_proj": self.heads, "k_proj": self.kv_heads}.get(name.split(".")[-2])
        if heads is None:
            return None
        rows = self.shape(name)[0]
        half = rows // heads // 2
        # The file holds, per head, (i, s) at row 2 i + s for HF's s * half + i.
        return torch.arange(rows).view(heads, half, 2).transpose(1, 2).reshape(rows)

    def raw(self, name: str, part: Part | None = None) -> torch.Tensor:
        """A quantized tensor's rows as the file's blocks: uint8 [rows, blocks x bytes], in
        HF row order, only ``part``'s rows, or its columns on whole blocks."""
        tensor, qtype = self._tensor(name), self.qtype(name)
        if qtype not in BLOCK_BYTES:
            raise WeightError(f"{name}: {qtype.name} is not kept quantized")
        data = self._data(name, tensor)
        raw = torch.from_numpy(np.array(data, dtype=np.uint8))  # a copy: the map is read-only
        order = self._rows(name)
        if order is not None:
            raw = raw[order]
        if part is None:
            return raw
        if part.dim == 0:
            return raw[part.start : part.stop]
        if part.start % BLOCK or part.stop % BLOCK:
            raise WeightError(
                f"{name}: columns [{part.start}, {part.stop}) do not fall on {qtype.name}'s "
                f"{BLOCK}-column blocks; use a tensor-parallel size whose split does"
            )
        width = BLOCK_BYTES[qtype]
        return raw[:, part.start // BLOCK * width : part.stop // BLOCK * width]

    def get(self, name: str, part: Part | None = None) -> torch.Tensor:
        """The tensor dequantized to float32 (gguf's own dequantize), ``part`` of it."""
        tensor, qtype = self._tensor(name), self.qtype(name)
        try:
            values = gguf.quants.dequantize(self._data(name, tensor), qtype)
        except NotImplementedError:
            raise WeightError(
                f"{name}: {qtype.name} cannot be dequantized by gguf {gguf_version()}; "
                f"these run: {type_names(KEPT + PLAIN)}, and the K-quants dequantized"
            ) from None
        out = torch.from_numpy(np.array(values, dtype=np.float32))  # a copy, as above
        out = out.reshape(self.shape(name))
        order = self._rows(name)
        if order is not None:
            out = out[order]
        if part is None:
            return out
        return out.narrow(part.dim, part.start, part.stop - part.start)

    def _data(self, name: str, tensor: Any) -> np.ndarray:
        try:
            data: np.ndarray = tensor.data
            return data
        except Exception as exc:
            raise WeightError(f"{name}: unreadable ({exc})") from None

    def close(self) -> None:
        self.reader = None  # type: ignore[assignment]  # the memory map goes with it


def fit_llama3_rope(
    divisors: np.ndarray, head_dim: int, theta: float, original: int | None
) -> Llama3RopeScaling | None:
    """The llama3 rope scaling whose frequencies are the unscaled ones over ``divisors``
    (within fp32 rounding), among factors of the largest divisor and the published models'
    values, low and high frequency factors 1 and 4 (also 0.5 to 8), and original
    contexts of ``original`` or a power of two from 1024 to 131072; None if none fits.
    Where several fit, they give the same frequencies at this ``head_dim``."""
    base = rope_inv_freq(head_dim, theta, None)
    factors = dict.fromkeys([float(divisors.max()), 8.0, 32.0, 16.0, 4.0, 2.0])
    originals = [original] if original else [2**i for i in range(10, 18)]
    for factor in factors:
        for low, high in ((1.0, 4.0), (1.0, 2.0), (1.0, 8.0), (0.5, 4.0), (2.0, 8.0)):
            for context in originals:
                scaling = Llama3RopeScaling(factor, low, high, context)
                got = (base / rope_inv_freq(head_dim, theta, scaling)).numpy()
                if np.allclose(got, divisors, rtol=1e-5, atol=0.0):
                    return scaling
    return None


class GgufLinear(nn.Module):
    """A projection whose weight stays in its file's Q4_0, Q4_1 or Q8_0 blocks."""

    def __init__(
        self, in_features: int, out_features: int, qtype: QType, bias: nn.Parameter | None
    ) -> None:
        super().__init__()
        self.in_features, self.out_features, self.qtype = in_features, out_features, qtype
        self.packed: torch.Tensor
        shape = (out_features // ROWS, in_features // BLOCK, ROWS * BLOCK_BYTES[qtype])
        self.register_buffer("packed", torch.empty(shape, dtype=torch.uint8))
        self.bias = bias
        self.use_kernel = False  # set by fill_gguf, once the kernels are known to run

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.use_kernel or x.dtype not in (torch.bfloat16, torch.float32):
            return reference_linear(x, self.packed, self.qtype, self.bias)
        flat = x.reshape(-1, self.in_features).contiguous()
        out: torch.Tensor = torch.ops.tandem_cpu.gguf_linear(
            flat, self.packed, int(self.qtype), self.out_features, self.bias
        )  # kernels.cpu.gguf_linear.linear, without its checks: a step calls it 121 times
        return out.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"type={self.qtype.name}, bias={self.bias is not None}"
        )


class GgufEmbedding(nn.Module):
    """Token embeddings read from quantized blocks, each looked-up row dequantized: a
    tied LM head's own ``GgufLinear`` (``source``), or blocks of its own."""

    def __init__(self, source: GgufLinear, dtype: torch.dtype) -> None:
        super().__init__()
        self._source = (source,)  # not registered: the LM head owns the blocks
        self.dtype = dtype

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        source = self._source[0]
        rows = dequantize_packed(source.qtype, source.packed, tokens.reshape(-1))
        return rows.to(self.dtype).view(*tokens.shape, source.in_features)


def _kept(reader: GgufCheckpoint, rule: TensorRule) -> QType | None:
    """The one kept type of all ``rule``'s sources, else None (they load dequantized)."""
    types = {reader.qtype(src.name) for src in rule.sources}
    for src in rule.sources:
        check_source(reader, src)  # type: ignore[arg-type]
        part = src.part
        if part is not None and part.dim == 1 and (part.start % BLOCK or part.stop % BLOCK):
            return None  # a tensor-parallel split inside a block: dequantized
    if len(types) != 1 or next(iter(types)) not in KEPT:
        return None
    rows = sum(
        src.part.stop - src.part.start if src.part and src.part.dim == 0 else src.shape[0]
        for src in rule.sources
    )
    if rows % ROWS:
        return None
    return next(iter(types))


def quantized_rules(
    reader: GgufCheckpoint, model: nn.Module, rules: Sequence[TensorRule]
) -> dict[str, QType]:
    """dst -> kept type, for the rules that fill a projection's weight (or a tied
    embedding) from sources all of one kept type; the others load dequantized."""
    found: dict[str, QType] = {}
    for rule in rules:
        qtype = _kept(reader, rule) if rule.dst.endswith(".weight") else None
        if qtype is None:
            continue
        module = model.get_submodule(rule.dst.removesuffix(".weight"))
        # A split embedding (tensor parallelism) stays a VocabParallelEmbedding, dequantized.
        if isinstance(module, nn.Linear) or type(module) is nn.Embedding:
            found[rule.dst] = qtype
    return found


def swap_gguf(model: nn.Module, kept: dict[str, QType], tied: bool) -> None:
    """On the meta device: a ``GgufLinear`` for every projection ``kept`` fills, and a
    ``GgufEmbedding`` on its LM head's blocks where the embedding is tied to it."""
    for dst, qtype in kept.items():
        path = dst.removesuffix(".weight")
        if path == "embed_tokens":
            continue
        parent_path, _, attr = path.rpartition(".")
        parent = model.get_submodule(parent_path) if parent_path else model
        linear = getattr(parent, attr)
        bias = linear.bias if isinstance(linear.bias, nn.Parameter) else None
        with torch.device("meta"):
            swapped = GgufLinear(linear.in_features, linear.out_features, qtype, bias)
        setattr(parent, attr, swapped)
    if "embed_tokens.weight" in kept:
        embed = model.get_submodule("embed_tokens")
        assert isinstance(embed, nn.Embedding)
        qtype = kept["embed_tokens.weight"]
        with torch.device("meta"):
            head = GgufLinear(embed.embedding_dim, embed.num_embeddings, qtype, None)
        lookup = GgufEmbedding(head, embed.weight.dtype)
        if tied:
            model.lm_head = head
        else:  # blocks of its own
            lookup.register_module("blocks", head)
        model.embed_tokens = lookup


def fill_gguf(
    model: nn.Module, reader: GgufCheckpoint, rules: Sequence[TensorRule], kept: dict[str, QType]
) -> None:
    """Fills what ``swap_gguf`` prepared, once the model is materialised (buffers, not
    parameters: ``load_weights`` fills the rest)."""
    use_kernel = kernel_runs()
    modules: dict[str, GgufLinear] = {}
    for dst in kept:
        module = model.get_submodule(dst.removesuffix(".weight"))
        found = module._source[0] if isinstance(module, GgufEmbedding) else module
        assert isinstance(found, GgufLinear)
        modules[dst] = found
    on_cpu = all(m.packed.device.type == "cpu" for m in modules.values())
    # On CPU every packed weight in one arena of huge pages (HugePageArena says why).
    arena = HugePageArena(HugePageArena.size_of([m.packed for m in modules.values()]))
    for rule in rules:
        if rule.dst not in kept:
            continue
        module = modules[rule.dst]
        raw = torch.cat([reader.raw(src.name, src.part) for src in rule.sources])
        packed = pack(kept[rule.dst], raw)
        module.packed = arena.place(packed) if on_cpu else packed.to(module.packed.device)
        module.use_kernel = use_kernel and on_cpu
    if not use_kernel and kept:
        logger.warning(
            "GGUF products run dequantized on aten: this CPU lacks AVX-512 VNNI, or the C++ "
            "kernels are not built (`%s`)",
            cpu_kernels.BUILD_COMMAND,
        )


def gguf_file(model_dir: str | Path) -> Path | None:
    """The GGUF file a model directory serves (``model.gguf``, a file or a link to one,
    as ``engine.model_store`` writes it), or None for a safetensors directory."""
    path = Path(model_dir) / GGUF_NAME
    return path.resolve() if path.exists() else None
