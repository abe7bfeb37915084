"""A drafter's chain of one-token forwards (``propose_chain``) lays out all its forwards
at once (``chain_layouts``): each layout equals the one ``draft_layout`` builds for its
position alone, field for field, its per-token tensors contiguous (the kernels index them
flat)."""

from __future__ import annotations

import dataclasses

import torch

from engine.spec.drafters.base import ProposeArgs, chain_layouts, draft_layout


def test_a_chains_layouts_equal_each_forwards_own() -> None:
    g = torch.Generator().manual_seed(0)
    b, width, block_size = 5, 9, 4
    tables = torch.randperm(64, generator=g)[: b * width].view(b, width)
    last = torch.tensor([0, 3, 7, 12, 20])  # rows crossing block boundaries as they go
    args = ProposeArgs(
        last_index=torch.arange(b),
        last_positions=last,
        next_tokens=torch.zeros(b, dtype=torch.int64),
        block_tables=tables,
        block_size=block_size,
        max_context_len=30,
    )
    layouts = chain_layouts(args, 4)
    assert len(layouts) == 4 and chain_layouts(args, 0) == []
    for j, got in enumerate(layouts):
        want = draft_layout((last + 1 + j)[:, None], args)
        for field in dataclasses.fields(want):
            a, w = getattr(got, field.name), getattr(want, field.name)
            if isinstance(w, torch.Tensor):
                assert torch.equal(a, w) and a.is_contiguous(), (j, field.name, a, w)
            else:
                assert a == w, (j, field.name, a, w)
    # Row 3 at position 13 (j = 0): block 13 // 4 = 3 of its table, offset 1.
    assert int(layouts[0].slot_mapping[3]) == int(tables[3, 3]) * block_size + 1
