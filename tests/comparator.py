"""The tie-aware comparator every equality test uses (see CONVENTIONS.md).

Walk Tandem's and the reference's tokens; at the first difference take the reference
model's fp32 logits at that position. The difference is a tie, and the rest of the row
is skipped, only if Tandem's token is among the reference's top two and their logits
differ by less than ``tie_tolerance``; anything else fails with the position, both
tokens and the gap.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

# (prompt, output so far, the reference's logits) -> the logits greedy takes the argmax of
# (a request's logit bias and penalties); None: the raw logits.
AdjustLogits = Callable[[list[int], list[int], torch.Tensor], torch.Tensor]


@dataclass
class Comparison:
    num_rows: int
    num_ties: int
    tie_positions: list[tuple[int, int]]  # (row, position in the output)


def reference_logits(model: torch.nn.Module, token_ids: list[int]) -> torch.Tensor:
    """The reference model's fp32 logits for the token after ``token_ids``. [V]"""
    with torch.inference_mode():
        ids = torch.tensor([token_ids])
        logits: torch.Tensor = model(ids, attention_mask=torch.ones_like(ids)).logits[0, -1]
    return logits.float()


def compare_greedy(
    reference_model: torch.nn.Module,
    prompts: list[list[int]],
    ours: list[list[int]],
    refs: list[list[int]],
    tie_tolerance: float = 1e-4,
    adjust: AdjustLogits | None = None,
) -> Comparison:
    """Asserts row by row that ``ours`` equals ``refs`` up to accepted ties."""
    assert len(prompts) == len(ours) == len(refs)
    ties: list[tuple[int, int]] = []
    for row, (prompt, mine, theirs) in enumerate(zip(prompts, ours, refs, strict=True)):
        assert len(mine) == len(theirs), (
            f"row {row}: Tandem produced {len(mine)} tokens, the reference {len(theirs)}"
        )
        diff = next((j for j, (a, b) in enumerate(zip(mine, theirs, strict=True)) if a != b), None)
        if diff is None:
            continue
        logits = reference_logits(reference_model, prompt + theirs[:diff])
        if adjust is not None:
            logits = adjust(prompt, theirs[:diff], logits)
        top2 = logits.topk(2).indices.tolist()
        gap = (logits[theirs[diff]] - logits[mine[diff]]).abs().item()
        if mine[diff] in top2 and gap < tie_tolerance:
            ties.append((row, diff))
            continue
        raise AssertionError(
            f"row {row} differs at output position {diff}: Tandem {mine[diff]}, reference "
            f"{theirs[diff]}, logit gap {gap:.3g} (reference top-2 {top2}); "
            f"Tandem {mine[: diff + 1]} vs reference {theirs[: diff + 1]}"
        )
    return Comparison(num_rows=len(prompts), num_ties=len(ties), tie_positions=ties)
