"""The W8A8 block-FP8 product (``kernels/triton/fp8_gemm.py``) through Triton's interpreter
on CPU: activations quantized per token per block bit for bit as torch's float8_e4m3fn
conversion does (ties to even, subnormals, the carry into the next binade); products equal
to the same quantization in plain torch up to fp32 summation order, and to the unquantized
activations within the error bound of rounding them to FP8."""

from __future__ import annotations

import pytest
import torch

from kernels.reference import fp8_gemm as reference

FP8 = torch.float8_e4m3fn


@pytest.fixture(scope="module")
def ops():  # imported here: conftest sets TRITON_INTERPRET before kernels.triton loads
    from kernels.triton import fp8_gemm

    return fp8_gemm


def all_fp8_values() -> torch.Tensor:
    """Every finite non-negative float8_e4m3fn value, ascending (0 to 448)."""
    codes = torch.arange(0, 0x7F, dtype=torch.uint8)  # 0x7F is NaN
    return codes.view(FP8).float()


def test_quantization_rounds_every_value_as_torch_does(ops, device) -> None:
    # Every FP8 value, every midpoint between neighbours (a tie: to even), and a hair
    # either side of it, signed; each row's first channel is 448, so its scale is 1.
    values = all_fp8_values()
    mid = (values[1:] + values[:-1]) / 2
    hair = torch.nextafter(mid, torch.zeros_like(mid)), torch.nextafter(mid, mid + 1)
    probes = torch.cat([values, mid, *hair, torch.tensor([31.003, 447.9, 1e-30])])
    probes = torch.cat([probes, -probes])
    group = 64
    rows = -(-probes.numel() // (group - 1))
    x = torch.zeros(rows, group)
    x[:, 0] = 448.0
    body = torch.zeros(rows * (group - 1))
    body[: probes.numel()] = probes
    x[:, 1:] = body.view(rows, group - 1)
    q, scale = ops.quantize_per_token_group(x.to(device), group)
    assert torch.equal(scale.cpu(), torch.ones(rows, 1))
    expected = x.to(FP8)
    assert torch.equal(q.cpu().view(torch.uint8), expected.view(torch.uint8))


def test_quantization_scales_each_tokens_groups(ops, device) -> None:
    torch.manual_seed(0)
    x = torch.randn(7, 320) * torch.logspace(-3, 2, 320)  # a part group at the end
    x[3, 200] = 900.0  # an outlier takes its group's scale alone
    x[5, :128] = 0.0  # a group of zeros
    x[6, 250] = float("nan")  # a NaN makes its group's scale and codes NaN, as in torch
    q, scale = ops.quantize_per_token_group(x.to(device), 128)
    assert q.shape == (7, 320) and scale.shape == (7, 3)
    want_q, want_scale = reference.quantize_per_token_group(x, 128)
    assert scale[6, 1].isnan() and want_scale[6, 1].isnan()
    assert q[6, 128:256].float().isnan().all() and want_q[6, 128:256].float().isnan().all()
    q[6, 128:256], want_q[6, 128:256] = 0.0, 0.0
    scale[6, 1], want_scale[6, 1] = 0.0, 0.0
    assert torch.equal(scale.cpu(), want_scale)
    assert torch.equal(q.cpu().view(torch.uint8), want_q.view(torch.uint8))
    assert q[3, 200].float().item() == 448.0 and not q[5, :128].float().any()


def fp8_weight(n: int, k: int, block_k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(weight [n, k] in FP8, its scales [n, ceil(k / block_k)] a hundred times apart)."""
    g = torch.Generator().manual_seed(seed)
    weight = torch.randn(n, k, generator=g).clamp(-8, 8).to(FP8)
    scale = 10 ** (torch.rand(n, -(-k // block_k), generator=g) * 2 - 3)
    return weight, scale


@pytest.mark.parametrize(
    ("m", "n", "k", "block_k", "bias"),
    [
        (1, 96, 320, 128, False),
        (5, 200, 256, 64, True),
        (40, 72, 96, 32, False),
        (70, 130, 300, 128, True),
    ],
)
def test_products_equal_fp8_arithmetic_within_its_bound(ops, device, m, n, k, block_k, bias):
    torch.manual_seed(m)
    x = torch.randn(m, k) * torch.logspace(-2, 1, k)
    weight, scale = fp8_weight(n, k, block_k, seed=n)
    b = torch.randn(n) if bias else None
    on = (t.to(device) if t is not None else None for t in (x, weight, scale, b))
    x_on, weight_on, scale_on, b_on = on
    out = ops.block_fp8_linear(x_on, weight_on, scale_on, block_k, b_on).cpu()
    assert out.shape == (m, n) and out.dtype == torch.float32
    # The same quantization in plain torch: equal up to the order of fp32 sums.
    w_deq = weight.float() * scale.repeat_interleave(block_k, 1)[:, :k]
    magnitude = x.abs() @ w_deq.abs().T
    want = reference.block_fp8_linear(x, weight, scale, block_k, b)
    assert ((out - want).abs() <= 1e-5 * magnitude + 1e-6).all()
    # Against unquantized activations: each is off by at most half an FP8 step, 2**-4 of
    # its size for a normal value (3 mantissa bits), or 2**-10 of its group's scale below
    # FP8's least normal 2**-6 (steps of 2**-9), its group's scale being amax / 448.
    exact = x @ w_deq.T + (0 if b is None else b)
    groups = torch.zeros(m, -(-k // block_k) * block_k)
    groups[:, :k] = x.abs()
    group_scale = groups.view(m, -1, block_k).amax(-1) / 448.0
    step = 2.0**-4 * x.abs() + 2.0**-10 * group_scale.repeat_interleave(block_k, 1)[:, :k]
    bound = step @ w_deq.abs().T + 1e-5 * magnitude + 1e-6
    error = (out - exact).abs()
    assert (error <= bound).all()
    assert error.max() > 1e-4 * magnitude.max()  # the activations were quantized


def test_bf16_activations_give_bf16_products(ops, device) -> None:
    torch.manual_seed(1)
    x = torch.randn(3, 128).to(torch.bfloat16)
    weight, scale = fp8_weight(48, 128, 128, seed=2)
    out = ops.block_fp8_linear(x.to(device), weight.to(device), scale.to(device), 128).cpu()
    assert out.dtype == torch.bfloat16
    want = reference.block_fp8_linear(x, weight, scale, 128)
    assert torch.allclose(out.float(), want.float(), rtol=2**-7, atol=1e-3)


def test_blocks_the_kernel_cannot_run_are_refused(ops) -> None:
    blocks = (16, 32, 48, 64, 100, 128, 256, 512)
    assert [b for b in blocks if ops.supports(b)] == [32, 64, 128, 256]
    q = torch.zeros(1, 96, dtype=FP8)
    with pytest.raises(ValueError, match="block_k 48: a power of two from 32 to 256 runs"):
        ops.block_fp8_matmul(q, torch.ones(1, 2), q, torch.ones(1, 2), 48, torch.float32)


def test_the_engine_runs_kept_fp8_projections_as_w8a8(ops, tmp_path, monkeypatch) -> None:
    """A block-FP8 Llama-3 on the GPU path keeps its projections FP8 by default ("auto")
    and runs each as the W8A8 kernel: the tokens and logprobs of the torch path whose
    projections compute the same quantization in plain torch. Blocks the kernel cannot run
    are dequantized, or refused when told to keep them."""
    from engine.fp8 import BlockFp8, Fp8Linear, QuantizationError
    from engine.models.triton_layers import TritonFp8Linear
    from tests.engine.test_fp8 import QUANTIZED, build_fp8, write_fp8
    from tests.kernels.triton.test_triton_engine_path import assert_same, run

    fp8_dir, _, _ = build_fp8(tmp_path, 320)

    def w8a8_in_torch(self: Fp8Linear, x: torch.Tensor) -> torch.Tensor:
        return reference.block_fp8_linear(x, self.weight, self.scale, self.block.block_k, self.bias)

    with monkeypatch.context() as patch:
        patch.setattr(Fp8Linear, "forward", w8a8_in_torch)
        expected, _ = run(fp8_dir, "torch", None, fp8_weights="keep")
    got, engine = run(fp8_dir, "triton", None)
    kept = [m for m in engine.runner.model.modules() if isinstance(m, TritonFp8Linear)]
    assert len(kept) == 2 * 4  # per layer: q/k/v, o, gate/up, down
    assert all(m.weight.dtype == FP8 for m in kept)
    assert_same(got, expected)
    # Blocks the kernel cannot run: "auto" dequantizes them at load time, "keep" is refused
    # before anything loads.
    (tmp_path / "odd").mkdir()
    write_fp8(tmp_path / "plain", tmp_path / "odd", BlockFp8(64, 48), QUANTIZED, seed=1)
    _, engine = run(tmp_path / "odd" / "fp8", "triton", None, prompts=("greedy",))
    assert not any(isinstance(m, TritonFp8Linear) for m in engine.runner.model.modules())
    refused = r"weight_block_size: blocks of 48 columns; the GPU's W8A8 kernel runs"
    with pytest.raises(QuantizationError, match=refused):
        run(tmp_path / "odd" / "fp8", "triton", None, fp8_weights="keep")
