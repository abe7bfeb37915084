"""The engine on the GPU path, through Triton's interpreter on CPU: the element-wise layers
(RMSNorm with the residual adds fused, within a layer and into the next layer's norm; RoPE,
YaRN's included; SiLU-and-mul) and the sampling kernels (filters, draws, rejection
sampling) give the tokens of the default torch path, fp32."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.components import kernels_for
from engine.llm_engine import EngineConfig, LLMEngine
from engine.models.layers import GatedMLP, RMSNorm
from engine.models.triton_layers import (
    FusedDecoder,
    TritonDecoderLayer,
    TritonGatedMLP,
    TritonLatentAttention,
    TritonLlama3Attention,
    TritonRMSNorm,
)
from engine.sampling_kernels import TORCH_SAMPLING, TritonSampling
from engine.sampling_params import SamplingParams
from engine.spec.config import SpeculativeConfig
from tests.engine.tiny_drafts import build_random_draft
from tests.engine.tiny_models import build_tiny_llama

PROMPTS = {"greedy": [5, 9, 3, 7, 11], "sampled": [7, 1, 9], "top": [4, 4, 2, 8]}


def params(rid: str) -> SamplingParams:
    """A greedy row, a seeded row with every filter, a seeded row at temperature 1.5."""
    if rid == "greedy":
        return SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True, logprobs=2)
    if rid == "sampled":
        return SamplingParams(max_tokens=5, temperature=0.8, top_k=20, top_p=0.9, min_p=0.02,
                              seed=7, ignore_eos=True, logprobs=2)  # fmt: skip
    return SamplingParams(max_tokens=5, temperature=1.5, seed=11, ignore_eos=True, logprobs=2)


def run(
    model: Path,
    attention: str,
    speculative: SpeculativeConfig | None,
    *,
    fuse: bool = True,
    dtype: str = "float32",
    device: str = "cpu",
    prompts: tuple[str, ...] = tuple(PROMPTS),
    **config: object,
) -> tuple[dict[str, list], LLMEngine]:
    """``fuse`` False: the Triton layers one by one, each adding its own residual stream.
    ``config``: more EngineConfig fields."""
    engine = LLMEngine(
        EngineConfig(model=str(model), dtype=dtype, device=device, kv_cache_memory=1 << 20,
                     block_size=4, attention_backend=attention, speculative=speculative,
                     **config)  # type: ignore[arg-type]
    )  # fmt: skip
    assert engine.kernels == ("triton" if attention == "triton" else "torch")
    if not fuse:
        del engine.runner.model.fused_decoder
    for rid in prompts:
        engine.add_request(rid, PROMPTS[rid], params(rid))
    done: dict[str, list] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = [out.token_ids, out.logprobs]
    return done, engine


def assert_same(triton: dict[str, list], torch_path: dict[str, list]) -> None:
    """Tokens equal; each token's logprob and its top two within fp32 tolerance."""
    assert triton.keys() == torch_path.keys()
    for rid in torch_path:
        assert triton[rid][0] == torch_path[rid][0], rid
        assert len(triton[rid][0]) == 5
        for a, b in zip(triton[rid][1], torch_path[rid][1], strict=True):
            assert a.token_id == b.token_id and a.top.keys() == b.top.keys()
            assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
            assert list(a.top.values()) == pytest.approx(list(b.top.values()), abs=1e-4)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tiny")
    build_tiny_llama(out, "gqa3_llama3rope_tied_bias_hd40", num_layers=2, vocab_size=64)
    return out


def test_auto_kernels_follow_the_attention_backend() -> None:
    assert kernels_for("auto", "torch") == "torch"
    assert kernels_for("auto", "triton") == kernels_for("auto", "flash_attn") == "triton"
    assert kernels_for("torch", "triton") == "torch"
    with pytest.raises(ValueError, match="kernels: 'cuda' is not one of auto, torch, triton"):
        EngineConfig(model="m", kernels="cuda")


def test_the_triton_path_swaps_every_layer_and_samples_as_the_torch_path(tiny) -> None:
    """Greedy, filtered and plain sampled rows: prefill, then decode."""
    expected, _ = run(tiny, "torch", None)
    got, engine = run(tiny, "triton", None)
    assert_same(got, expected)
    model = engine.runner.model
    assert all(isinstance(layer, TritonDecoderLayer) for layer in model.layers)
    assert isinstance(model.fused_decoder, FusedDecoder)  # adds fused across layers
    layer = model.layers[0]
    assert isinstance(layer.self_attn, TritonLlama3Attention)
    assert isinstance(layer.mlp, TritonGatedMLP) and isinstance(model.norm, TritonRMSNorm)
    assert isinstance(engine.runner.sampling_kernels, TritonSampling)


def test_kernels_torch_keeps_the_torch_modules_beside_triton_attention(tiny) -> None:
    config = EngineConfig(model=str(tiny), dtype="float32", kv_cache_memory=1 << 20,
                          block_size=4, attention_backend="triton", kernels="torch")  # fmt: skip
    engine = LLMEngine(config)
    assert type(engine.runner.model.layers[0]).__name__ == "Llama3DecoderLayer"
    assert engine.runner.sampling_kernels is TORCH_SAMPLING


def test_fusing_residual_adds_across_layers_changes_no_bit(tiny, tmp_path) -> None:
    """The layers' last adds fused into the next norms (and the final norm) give the same
    logprobs, bit for bit, as the Triton layers run one by one; with an EAGLE draft, which
    reads the target's final hidden state (the fused final norm's); one greedy row, as the
    interpreter is slow."""
    draft = build_random_draft(tiny, tmp_path / "eagle", "eagle")
    spec = SpeculativeConfig(str(draft), num_draft_tokens=2)
    fused, engine = run(tiny, "triton", spec, prompts=("greedy",))
    unfused, _ = run(tiny, "triton", spec, fuse=False, prompts=("greedy",))
    assert isinstance(engine.runner.model.fused_decoder, FusedDecoder)
    for rid in ("greedy",):
        assert fused[rid][0] == unfused[rid][0], rid
        for a, b in zip(fused[rid][1], unfused[rid][1], strict=True):
            assert (a.token_id, a.logprob, a.top) == (b.token_id, b.logprob, b.top)


@pytest.mark.gpu
def test_fusing_residual_adds_changes_no_bit_in_bf16_on_a_gpu(tiny, tmp_path) -> None:
    """bf16 (which the interpreter computes wrongly), compiled: fused and one by one agree
    bit for bit, the sums being the same bf16 adds."""
    draft = build_random_draft(tiny, tmp_path / "eagle", "eagle")
    spec = SpeculativeConfig(str(draft), num_draft_tokens=2)
    fused, _ = run(tiny, "triton", spec, dtype="bfloat16", device="cuda")
    unfused, _ = run(tiny, "triton", spec, fuse=False, dtype="bfloat16", device="cuda")
    for rid in PROMPTS:
        assert fused[rid][0] == unfused[rid][0], rid
        for a, b in zip(fused[rid][1], unfused[rid][1], strict=True):
            assert (a.token_id, a.logprob, a.top) == (b.token_id, b.logprob, b.top)


@pytest.mark.parametrize("sample_drafts", [False, True])
def test_eagle3_on_the_triton_path_equals_the_torch_path(tiny, tmp_path, sample_drafts) -> None:
    """The unified step with an EAGLE-3 draft (its layer swapped too): greedy rows, and
    sampled rows through the rejection kernel with argmax drafts, or with sampled drafts
    (the filter and draw kernels propose, rejection against their q)."""
    draft = build_random_draft(tiny, tmp_path / "eagle3", "eagle3")
    spec = SpeculativeConfig(str(draft), num_draft_tokens=2, sample_drafts=sample_drafts)
    expected, _ = run(tiny, "torch", spec)
    got, engine = run(tiny, "triton", spec)
    assert_same(got, expected)
    assert engine.spec is not None
    modules = list(engine.spec.drafter.modules())  # type: ignore[attr-defined]
    assert any(isinstance(m, TritonRMSNorm) for m in modules)
    assert any(isinstance(m, TritonLlama3Attention) for m in modules)
    assert any(isinstance(m, TritonGatedMLP) for m in modules)


@pytest.mark.parametrize(
    "shape", ["qlora_yarn_mscale_interleaved", "q_proj_plain_rope_split_tied_bias"]
)
def test_deepseek_v3_on_the_triton_path_equals_the_torch_path(tmp_path, shape) -> None:
    """Its norms (latent ones included), dense MLP and experts take the kernels, its layers
    fuse their residual adds, and the latent attention's rope parts turn in the RoPE kernel:
    YaRN's frequencies and cos/sin factor with interleaved dims, or plain RoPE split."""
    from tests.engine.tiny_deepseek import build_tiny_deepseek

    build_tiny_deepseek(tmp_path, shape, num_layers=2)
    expected, _ = run(tmp_path, "torch", None)
    got, engine = run(tmp_path, "triton", None)
    assert_same(got, expected)
    model = engine.runner.model
    modules = list(model.modules())
    assert not any(isinstance(m, (RMSNorm, GatedMLP)) for m in modules)
    assert sum(isinstance(m, TritonGatedMLP) for m in modules) > 2  # experts too
    assert all(isinstance(layer.self_attn, TritonLatentAttention) for layer in model.layers)
    assert isinstance(model.fused_decoder, FusedDecoder)


def test_deepseek_v3_with_an_mla_eagle3_draft_on_the_triton_path(tmp_path) -> None:
    """The MLA EAGLE-3 draft's latent attention turns its rope parts in the kernel too
    (YaRN, interleaved), through the draft's dispatched metadata; greedy and sampled rows."""
    from tests.engine.tiny_deepseek import build_tiny_deepseek

    build_tiny_deepseek(tmp_path / "target", "qlora_yarn_mscale_interleaved", num_layers=2)
    draft = build_random_draft(tmp_path / "target", tmp_path / "eagle3", "eagle3")
    spec = SpeculativeConfig(str(draft), num_draft_tokens=2)
    rows = ("greedy", "sampled")
    expected, _ = run(tmp_path / "target", "torch", spec, prompts=rows)
    got, engine = run(tmp_path / "target", "triton", spec, prompts=rows)
    assert_same(got, expected)
    assert engine.spec is not None
    modules = list(engine.spec.drafter.modules())  # type: ignore[attr-defined]
    assert any(isinstance(m, TritonLatentAttention) for m in modules)
