"""The Triton kernels compiled on a GPU at Llama-3-8B's shapes, in bf16 too (Triton's
interpreter computes bf16 wrongly, so bf16 is checked here only). Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

from engine.config import Llama3RopeScaling
from engine.deepseek_v3_config import YarnRopeScaling
from engine.models.layers import rope_inv_freq
from engine.sampler import row_keys, uniform
from engine.sampler import sample as engine_sample
from engine.spec.acceptance import accept
from kernels.reference import attention as ref_attention
from kernels.reference import blocks as ref_blocks
from kernels.reference import elementwise as ref_elementwise
from kernels.reference import fp8_gemm as ref_fp8_gemm
from kernels.triton import attention, blocks, elementwise, sampling
from kv_transfer.checksum import checksum_kind, running_checksum
from kv_transfer.copying import byte_view, pack_runs, unpack_runs
from tests.kernels.triton.test_triton_attention import attend, make_case
from tests.kernels.triton.test_triton_sampling import (
    engine_inputs,
    engine_tensors,
)
from tests.kernels.triton.test_triton_sampling import (
    test_keys_and_uniforms_are_the_references_bits_in_one_kernel_each as check_keys,
)

pytestmark = pytest.mark.gpu

LLAMA3_8B = {"num_heads": 32, "num_kv_heads": 8, "head_dim": 128, "block_size": 16}
CUDA = torch.device("cuda")
# bf16 keeps 8 bits: the kernel rounds p to bf16 before p @ V, the reference does not.
TOLERANCE = {torch.bfloat16: 3e-2, torch.float16: 4e-3, torch.float32: 1e-5}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_verify_rows_at_llama3_8b_shapes_split_and_not(dtype) -> None:
    """8 rows of K+1 = 6 tokens, contexts from 6 to 4000 (the default splits the context)."""
    case = make_case([6] * 8, [6, 100, 511, 2048, 4000, 17, 1000, 3000], dtype=dtype,
                     device=CUDA, **LLAMA3_8B)  # fmt: skip
    want = attend(ref_attention, case, True)
    tol = TOLERANCE[dtype]
    for num_splits in (None, 1):
        got = attend(attention, case, True, num_splits=num_splits)
        torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)


def test_prefill_chunks_at_llama3_8b_shapes_bf16() -> None:
    query_lens, context_lens = [300, 700, 1], [300, 1200, 40]
    case = make_case(query_lens, context_lens, dtype=torch.bfloat16, device=CUDA, **LLAMA3_8B)
    t, bs = sum(query_lens), 16
    k = torch.randn(t, 8, 128, device=CUDA).bfloat16()
    v = torch.randn(t, 8, 128, device=CUDA).bfloat16()
    rows = torch.repeat_interleave(torch.arange(3, device=CUDA), torch.tensor(query_lens,
                                   device=CUDA))  # fmt: skip
    slots = case["block_tables"][rows, case["positions"] // bs] * bs + case["positions"] % bs
    outs = []
    for module in (attention, ref_attention):
        kc, vc = case["k_cache"].clone(), case["v_cache"].clone()
        args = dict(case, k=k, v=v, k_cache=kc, v_cache=vc, slot_mapping=slots)
        outs.append(module.prefill_attention(**args, scale=128**-0.5, is_causal=True,
                                             max_query_len=700))  # fmt: skip
    torch.testing.assert_close(outs[0].float(), outs[1].float(), rtol=3e-2, atol=3e-2)


def test_decode_attention_replays_from_a_cuda_graph() -> None:
    """No host synchronisation: captured once, replayed over new inputs, as eager."""
    case = make_case([1] * 16, list(range(100, 1700, 100)), dtype=torch.bfloat16, device=CUDA,
                     **LLAMA3_8B)  # fmt: skip
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        attend(attention, case, True, max_query_len=1)  # compiles outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = attend(attention, case, True, max_query_len=1)
    case["q"].copy_(torch.randn_like(case["q"]))
    case["context_lens"].sub_(7)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, attend(attention, case, True, max_query_len=1))


def test_elementwise_at_llama3_8b_shapes_bf16() -> None:
    x = torch.randn(64, 4096, device=CUDA).bfloat16()
    residual = torch.randn_like(x)
    weight = torch.randn(4096, device=CUDA).bfloat16()
    got = elementwise.rms_norm(x, weight, 1e-5, residual)
    want = ref_elementwise.rms_norm(x, weight, 1e-5, residual)
    assert torch.equal(got[1], want[1])
    torch.testing.assert_close(got[0], want[0], rtol=1e-2, atol=1e-2)
    scaling = Llama3RopeScaling(8.0, 1.0, 4.0, 8192)
    inv_freq = rope_inv_freq(128, 500000.0, scaling).to(CUDA)
    qk = torch.randn(64, 40, 128, device=CUDA).bfloat16()
    positions = torch.randint(0, 100000, (64,), device=CUDA)
    torch.testing.assert_close(
        elementwise.rope(qk, positions, inv_freq),
        ref_elementwise.rope(qk, positions, inv_freq),
        rtol=1e-2,
        atol=1e-2,
    )
    gate_up = torch.randn(64, 2 * 14336, device=CUDA).bfloat16()
    torch.testing.assert_close(
        elementwise.silu_and_mul(gate_up), ref_elementwise.silu_and_mul(gate_up),
        rtol=1e-2, atol=1e-2,
    )  # fmt: skip


def test_block_runs_copy_exactly_at_llama3_8b_block_shapes() -> None:
    pool = torch.randn(512, 16, 8, 128, device=CUDA).bfloat16()
    starts = torch.tensor([7, 100, 300], device=CUDA)
    offsets = torch.tensor([0, 40, 41, 141], device=CUDA)
    staging = torch.empty(141, 16, 8, 128, device=CUDA, dtype=torch.bfloat16)
    blocks.gather_block_runs(pool, starts, offsets, staging)
    assert torch.equal(staging, pool[ref_blocks.run_block_ids(starts, offsets, 141)])
    other = torch.zeros_like(pool)
    blocks.scatter_block_runs(staging, other, starts, offsets)
    want = torch.zeros_like(pool)
    ref_blocks.scatter_block_runs(staging, want, starts, offsets)
    assert torch.equal(other, want)


def test_yarn_rope_at_deepseek_v3_shapes_bf16() -> None:
    """128 heads' query rope parts (64 interleaved dims, strided rows of 192), YaRN's
    frequencies (DeepSeek-V3's), a cos/sin factor other than 1."""
    yarn = YarnRopeScaling(40.0, 4096, 32.0, 1.0, mscale=1.0, mscale_all_dim=0.8)
    inv_freq, factor = yarn.inv_freq(64, 10000.0).to(CUDA), yarn.cos_sin_factor
    q = torch.randn(64, 128, 192, device=CUDA).bfloat16()
    positions = torch.randint(0, 160000, (64,), device=CUDA)
    for x in (q[..., 128:], q[:, :1, 128:]):  # queries, then a key's shape [T, 1, R]
        torch.testing.assert_close(
            elementwise.rope(x, positions, inv_freq, factor, True),
            ref_elementwise.rope(x, positions, inv_freq, factor, True),
            rtol=1e-2, atol=1e-2,
        )  # fmt: skip


def test_kv_transfer_copies_cuda_pools_through_the_block_kernels_bf16() -> None:
    """CUDA pools pack and unpack by default through the Triton gather and scatter: the
    bytes and checksum of the CPU pools' torch path, at Llama-3-8B's block shape."""
    kv = [torch.randn(64, 16, 8, 128, device=CUDA).bfloat16() for _ in range(2)]
    runs = [(7, 10), (30, 1), (40, 3)]
    num_bytes = 14 * 2 * kv[0][0].numel() * 2
    kind = checksum_kind("auto")
    packed = []
    for pools in (kv, [t.cpu() for t in kv]):
        buffer, running = torch.empty(num_bytes, dtype=torch.uint8), running_checksum(kind)
        view = byte_view(buffer)
        assert view is not None
        assert pack_runs(view, pools, runs, running) == num_bytes
        packed.append((buffer, running.intdigest()))
    assert torch.equal(packed[0][0], packed[1][0]) and packed[0][1] == packed[1][1]
    wire = byte_view(packed[0][0])
    assert wire is not None
    dst = [torch.zeros_like(t) for t in kv]
    running = running_checksum(kind)
    assert unpack_runs(dst, [(0, 10), (20, 1), (50, 3)], wire, running) == num_bytes
    assert running.intdigest() == packed[0][1]
    dst_ids, src_ids = [*range(10), 20, 50, 51, 52], [*range(7, 17), 30, 40, 41, 42]
    for got, src in zip(dst, kv, strict=True):
        assert torch.equal(got[dst_ids], src[src_ids])


def test_sampling_at_the_llama3_vocabulary_equals_the_engine() -> None:
    b, vocab = 8, 128256
    logits = torch.randn(b, vocab, device=CUDA) * 3
    p = {
        "temperature": torch.tensor([0.7, 1.0, 1.3, 0.0, 1.0, 0.9, 0.6, 1.1], device=CUDA),
        "top_k": torch.tensor([50, 0, 20, 0, 0, 1000, 0, 5], device=CUDA),
        "top_p": torch.tensor([0.9, 0.8, 1.0, 1.0, 0.95, 0.7, 1.0, 1.0], device=CUDA),
        "min_p": torch.tensor([0.0, 0.0, 0.1, 0.0, 0.05, 0.0, 0.02, 0.0], device=CUDA),
    }
    seeds = torch.arange(b, device=CUDA) * 31337
    positions = torch.full((b,), 77, device=CUDA)
    u = uniform(row_keys(seeds, positions), 1)[:, 0]
    want = engine_sample(logits, engine_tensors(p, seeds, positions))
    assert torch.equal(sampling.sample(logits, **p, uniforms=u), want)


def test_compiled_keys_and_uniforms_are_the_references_bits() -> None:
    """The interpreter's int64 products wrap as numpy's; compiled, as LLVM's."""
    check_keys(CUDA)


def test_rejection_sampling_at_the_llama3_vocabulary_equals_the_engines_accept() -> None:
    b, k, vocab = 8, 5, 128256
    logits = torch.randn(b, k + 1, vocab, device=CUDA) * 6
    drafts = logits[:, :k].argmax(-1)
    q = (logits[:, :k] + torch.randn(b, k, vocab, device=CUDA)).softmax(-1)
    seeds = torch.arange(b, device=CUDA) * 7 + 1
    first = torch.arange(b, device=CUDA) + 500
    sampling_tensors, probs, draw_u, accept_u = engine_inputs(logits, seeds, first)
    for draft_probs in (None, q):
        want = accept(logits, drafts, sampling_tensors, first, draft_probs=draft_probs)
        if draft_probs is None:
            got = sampling.rejection_sample(probs, drafts, draw_u)
        else:
            got = sampling.rejection_sample(probs, drafts, draw_u, draft_probs, accept_u)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.parametrize("rows", [1, 8, 64, 300])
def test_w8a8_block_fp8_at_deepseek_v3_shapes_bf16(rows: int) -> None:
    """DeepSeek-V3's MLP down projection (2048 -> 7168) and its transpose, 128x128 blocks:
    the activations' FP8 codes equal torch's conversion; the product equals the same
    quantization in torch within bf16's rounding of the result."""
    from kernels.triton import fp8_gemm

    torch.manual_seed(rows)
    for n, k in ((7168, 2048), (2048, 7168)):
        x = (torch.randn(rows, k, device=CUDA) * 3).to(torch.bfloat16)
        weight = torch.randn(n, k, device=CUDA).clamp(-8, 8).to(torch.float8_e4m3fn)
        scale = 10 ** (torch.rand(n, k // 128, device=CUDA) * 2 - 3)
        q, q_scale = fp8_gemm.quantize_per_token_group(x, 128)
        want_q, want_scale = ref_fp8_gemm.quantize_per_token_group(x, 128)
        assert torch.equal(q_scale, want_scale)
        assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))
        got = fp8_gemm.block_fp8_linear(x, weight, scale, 128).float()
        want = ref_fp8_gemm.block_fp8_linear(x.float(), weight, scale, 128)
        magnitude = x.float().abs() @ (weight.float() * scale.repeat_interleave(128, 1)).abs().T
        # Hopper accumulates FP8 products in the tensor cores at about 14 bits, promoted to
        # fp32 once per 128-column block (as DeepSeek-V3 was trained); bf16 rounds the result.
        assert ((got - want).abs() <= 2**-8 * want.abs() + 2**-12 * magnitude + 1e-6).all()
