"""Compiles every Triton kernel for a Hopper GPU (sm_90) down to a cubin, with no GPU:
Triton's own code generator, LLVM and the ptxas its wheel carries. It catches what the
interpreter lets through (non-constexpr globals, branch types that do not unify, ops with
no GPU lowering). Run without TRITON_INTERPRET: ``python -m tests.kernels.triton.compile_for_gpu``.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

HOPPER = GPUTarget("cuda", 90, 32)


def compile_kernel(fn: Any, types: dict[str, str], constexprs: dict[str, Any]) -> None:
    """Unnamed arguments are i32 scalars."""
    signature = {
        name: "constexpr" if name in constexprs else types.get(name, "i32") for name in fn.arg_names
    }
    compiled = triton.compile(ASTSource(fn, signature, constexprs=constexprs), target=HOPPER)
    assert compiled.asm["cubin"], fn.__name__
    print(f"compiled {fn.__name__} {constexprs}")


def main() -> None:
    if os.environ.get("TRITON_INTERPRET") == "1":
        sys.exit("run without TRITON_INTERPRET=1: interpreted kernels cannot be compiled")
    from kernels.triton import attention, blocks, elementwise, sampling

    i64 = "*i64"
    for dtype, is_split in (("bf16", True), ("fp32", False)):
        compile_kernel(
            attention._attention_kernel,
            {"q_ptr": f"*{dtype}", "k_cache_ptr": f"*{dtype}", "v_cache_ptr": f"*{dtype}",
             "out_ptr": f"*{dtype}", "part_o_ptr": "*fp32", "part_lse_ptr": "*fp32",
             "block_tables_ptr": i64, "context_lens_ptr": i64, "offsets_ptr": i64,
             "positions_ptr": i64, "scale": "fp32"},
            {"GROUP": 4, "HEAD_DIM": 128, "BLOCK_M": 32, "BLOCK_N": attention.BLOCK_N,
             "BLOCK_D": 128, "IS_CAUSAL": True, "IS_SPLIT": is_split,
             "PRECISION": "ieee" if dtype == "fp32" else "tf32"},
        )  # fmt: skip
    compile_kernel(
        attention._combine_kernel,
        {"out_ptr": "*bf16", "part_o_ptr": "*fp32", "part_lse_ptr": "*fp32"},
        {"NUM_SPLITS": 5, "SPLITS_POW2": 8, "HEAD_DIM": 128, "BLOCK_D": 128},
    )
    compile_kernel(
        attention._store_kernel,
        {
            "k_ptr": "*bf16",
            "v_ptr": "*bf16",
            "k_cache_ptr": "*bf16",
            "v_cache_ptr": "*bf16",
            "slots_ptr": i64,
        },
        {"NUM_HEADS": 8, "HEAD_DIM": 128, "BLOCK_H": 8, "BLOCK_D": 128},
    )
    compile_kernel(
        blocks._copy_runs_kernel,
        {
            "pool_ptr": "*bf16",
            "staging_ptr": "*bf16",
            "run_starts_ptr": i64,
            "run_offsets_ptr": i64,
            "stage_starts_ptr": i64,
        },
        {"IS_GATHER": True, "RUNS_POW2": 8, "CHUNK": 1024},
    )
    bf16 = "*bf16"
    compile_kernel(
        elementwise._rms_norm_kernel,
        {"x_ptr": bf16, "residual_ptr": bf16, "weight_ptr": bf16, "out_ptr": bf16,
         "new_residual_ptr": bf16, "eps": "fp32"},
        {"HAS_RESIDUAL": True, "BLOCK": 4096},
    )  # fmt: skip
    for is_interleaved, half in ((False, 64), (True, 32)):  # Llama-3's; DeepSeek-V3's YaRN
        compile_kernel(
            elementwise._rope_kernel,
            {"x_ptr": bf16, "out_ptr": bf16, "positions_ptr": i64, "inv_freq_ptr": "*fp32",
             "cos_sin_factor": "fp32"},
            {"HALF": half, "IS_INTERLEAVED": is_interleaved, "BLOCK_H": 64, "BLOCK_HALF": half},
        )  # fmt: skip
    compile_kernel(
        elementwise._silu_and_mul_kernel, {"x_ptr": bf16, "out_ptr": bf16}, {"BLOCK": 1024}
    )
    f32 = "*fp32"
    compile_kernel(
        sampling._filter_kernel,
        {"logits_ptr": f32, "out_ptr": f32, "temperature_ptr": f32, "top_k_ptr": i64,
         "top_p_ptr": f32, "min_p_ptr": f32},
        {"BLOCK": 1024},
    )  # fmt: skip
    compile_kernel(
        sampling._draw_kernel,
        {"weights_ptr": f32, "uniforms_ptr": f32, "out_ptr": i64},
        {"BLOCK": 1024},
    )
    for has_draft_probs in (True, False):
        compile_kernel(
            sampling._rejection_kernel,
            {"p_ptr": f32, "q_ptr": f32, "drafts_ptr": i64, "draw_u_ptr": f32,
             "accept_u_ptr": f32, "num_ptr": i64, "next_ptr": i64},
            {"HAS_DRAFT_PROBS": has_draft_probs, "BLOCK": 1024},
        )  # fmt: skip
    compile_kernel(
        sampling._row_keys_kernel,
        {"seeds_ptr": i64, "positions_ptr": i64, "out_ptr": i64},
        {"BLOCK": sampling._KEYS_BLOCK},
    )
    compile_kernel(
        sampling._uniform_kernel, {"keys_ptr": i64, "out_ptr": f32}, {"BLOCK": sampling._KEYS_BLOCK}
    )


if __name__ == "__main__":
    main()
