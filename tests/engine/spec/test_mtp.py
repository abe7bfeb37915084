"""DeepSeek-V3's own MTP layer as its draft (``--draft-method mtp``): read from the
target's files (the layer after the last, which the target never reads), it drafts
through its own latent cache, and speculative output equals target-only output, on one
device and split over two ranks with experts split. What cannot draft so is refused,
naming the field."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from engine.llm_engine import LLMEngine
from engine.models.llama3 import ReturnHiddenStates
from engine.spec.config import SpeculativeConfig
from engine.spec.drafters.base import DraftConfigError
from engine.spec.drafters.mtp import MtpDrafter
from tests.engine.parallel.test_tp_deepseek_v3 import greedy as tp_greedy
from tests.engine.tiny_deepseek import (
    build_tiny_deepseek,
    build_tiny_deepseek_with_mtp,
    make_mtp_know_the_target,
)
from tests.engine.tiny_models import build_tiny_llama

VOCAB = 97
MTP = SpeculativeConfig("", kind="mtp", num_draft_tokens=3)


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("mtp")
    build_tiny_deepseek_with_mtp(out, "qlora_yarn_mscale_interleaved", vocab_size=VOCAB)
    return out


def greedy(model_dir: Path, **kw: object) -> tuple[list[list[int]], LLMEngine]:
    """Greedy tokens of three prompts (``tp_greedy``'s engine; ``tensor_parallel_size``
    in ``kw``, default 1)."""
    rng = random.Random(2)
    prompts = [[rng.randrange(3, VOCAB) for _ in range(n)] for n in (5, 12, 3)]
    size = int(kw.pop("tensor_parallel_size", 1))  # type: ignore[call-overload]
    return tp_greedy(model_dir, prompts, size, **kw)


@pytest.mark.parametrize("size", [1, 2])
def test_mtp_drafts_leave_the_output_as_the_target_alone_gives(target, size) -> None:
    split = {"tensor_parallel_size": size, "enable_expert_parallel": size > 1}
    alone, _ = greedy(target, **split)
    ours, engine = greedy(target, speculative=MTP, **split)
    assert ours == alone
    assert engine.spec is not None and isinstance(engine.spec.drafter, MtpDrafter)
    stats = engine.spec.stats
    assert stats.num_draft_tokens > 0
    drafter = engine.spec.drafter
    assert drafter.target_hidden == ReturnHiddenStates(final=True)  # after the final norm
    assert len(engine.kv_pools["draft"].layers) == 1  # its own latent cache, one layer


def test_what_cannot_draft_with_mtp_is_refused(tmp_path) -> None:
    build_tiny_deepseek(tmp_path / "no_mtp", "qlora_yarn_mscale_interleaved", vocab_size=VOCAB,
                        num_layers=2)  # fmt: skip
    with pytest.raises(DraftConfigError, match="its checkpoint has no MTP layer"):
        greedy(tmp_path / "no_mtp", speculative=MTP)
    build_tiny_llama(tmp_path / "llama", "gqa4_llama3rope_hd72_mlpbias", num_layers=1,
                     vocab_size=VOCAB)  # fmt: skip
    with pytest.raises(DraftConfigError, match="mtp needs a DeepSeek-V3 target"):
        greedy(tmp_path / "llama", speculative=MTP)
    with pytest.raises(ValueError, match="reads its layer from the target's own files"):
        SpeculativeConfig("some/draft", kind="mtp")


def test_an_mtp_layer_that_knows_the_target_is_accepted_whole(tmp_path) -> None:
    """``make_mtp_know_the_target``: every draft is accepted (reading the target's hidden
    state first in its concatenation, none would be)."""
    out = tmp_path / "markov"
    build_tiny_deepseek_with_mtp(out, "qlora_yarn_mscale_interleaved", vocab_size=VOCAB)
    make_mtp_know_the_target(out)
    alone, _ = greedy(out)
    ours, engine = greedy(out, speculative=MTP)
    assert ours == alone
    assert engine.spec is not None
    assert engine.spec.stats.acceptance_rate > 0.9


def test_a_block_fp8_target_drafts_with_its_mtp_layer_dequantized(tmp_path) -> None:
    """As DeepSeek-V3 is released: the MTP layer's projections are FP8 too. They are
    dequantized at load time (the draft runs bf16 or the dtype's products), equal to the
    dequantized reference, and speculation stays lossless with the target kept FP8."""
    from safetensors.torch import load_file

    from engine.fp8 import BlockFp8
    from tests.engine.test_fp8 import DEEPSEEK_QUANTIZED, write_fp8

    plain = tmp_path / "plain"
    build_tiny_deepseek_with_mtp(plain, "qlora_yarn_mscale_interleaved", vocab_size=VOCAB)
    write_fp8(plain, tmp_path, BlockFp8(16, 32), DEEPSEEK_QUANTIZED, seed=5)
    assert (
        load_file(tmp_path / "fp8" / "model.safetensors")[
            "model.layers.3.self_attn.q_b_proj.weight"
        ].dtype
        == torch.float8_e4m3fn
    )
    alone, _ = greedy(tmp_path / "fp8", fp8_weights="keep")
    ours, engine = greedy(tmp_path / "fp8", fp8_weights="keep", speculative=MTP)
    assert ours == alone
    assert engine.spec is not None
    drafter = engine.spec.drafter
    reference = load_file(tmp_path / "dequantized" / "model.safetensors")
    assert torch.equal(
        drafter.block.self_attn.q_b_proj.weight,
        reference["model.layers.3.self_attn.q_b_proj.weight"],
    )
