"""One step under data-parallel attention, on each rank: the step's whole batch arrives
(rank 0's message, ``ForwardInputs.dp_ranks`` naming each row's rank), and each rank runs
its own rows over its own KV pool. ``data_parallel_splits`` keeps the seed's meaning:
which rows each rank owns, here as the tokens and logit rows of each rank, in rank order
(``DataParallelStep``), set before the forward so that the experts can gather every
rank's tokens. A rank with no rows joins the collectives all the same (``idle_pass``).

Every rank ends with every rank's logits, in rank order; ``forward`` puts them back in
the batch's order.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Callable

import torch

from engine.attention.base import BatchLayout
from engine.executor.inputs import ForwardInputs
from engine.models.llama3 import ModelOutputs
from engine.models.moe import DataParallelStep


def forward(
    inputs: ForwardInputs,
    dp: DataParallelStep,
    run: Callable[[ForwardInputs], ModelOutputs],  # this rank's rows, on one device
    idle: Callable[[], ModelOutputs],
) -> ModelOutputs:
    """This rank's part of the step; the logits of every row that gets some, in order."""
    assert inputs.dp_ranks is not None
    # Neither a prefill worker's per-layer pushes nor a draft's hidden states run here yet
    # (EngineConfig refuses drafts with data-parallel attention).
    assert inputs.on_layer is None and not inputs.return_hidden_states.layer_ids
    layout = inputs.layout
    assert layout.query_lens is not None and layout.context_lens_host is not None
    row_ranks = inputs.dp_ranks.tolist()
    query_lens = layout.query_lens
    offsets = [0, *itertools.accumulate(query_lens)]
    logit_tokens = inputs.logit_indices.tolist()
    logit_ranks = [row_ranks[bisect.bisect_right(offsets, t) - 1] for t in logit_tokens]
    size, me = dp.group.size, dp.group.shard.rank
    dp.data_parallel_splits = [[row for row, r in enumerate(row_ranks) if r == k]
                               for k in range(size)]  # fmt: skip
    dp.tokens = [sum(query_lens[row] for row in rows) for rows in dp.data_parallel_splits]
    dp.logits = [logit_ranks.count(k) for k in range(size)]
    mine = dp.data_parallel_splits[me]
    out = run(_rows(inputs, mine, offsets, logit_tokens)) if mine else idle()
    # Rank-major back to the batch's order: the j-th logit row of rank k sits at
    # start[k] + j of what every rank gathered.
    start = [0, *itertools.accumulate(dp.logits)]
    seen = [0] * size
    order = []
    for rank in logit_ranks:
        order.append(start[rank] + seen[rank])
        seen[rank] += 1
    out.logits = out.logits[torch.tensor(order, dtype=torch.int64, device=out.logits.device)]
    return out


def _rows(
    inputs: ForwardInputs, rows: list[int], offsets: list[int], logit_tokens: list[int]
) -> ForwardInputs:
    """``inputs`` cut down to ``rows`` (their tokens, KV slots, block tables and logits)."""
    layout = inputs.layout
    assert layout.query_lens is not None and layout.context_lens_host is not None
    device = inputs.tokens.device
    kept = [t for row in rows for t in range(offsets[row], offsets[row + 1])]
    new_index = {t: i for i, t in enumerate(kept)}
    index = torch.tensor(kept, dtype=torch.int64, device=device)
    picked = torch.tensor(rows, dtype=torch.int64, device=device)
    query_lens = [layout.query_lens[r] for r in rows]
    context_lens = [layout.context_lens_host[r] for r in rows]
    sub = BatchLayout(
        input_row_offsets=torch.tensor(
            [0, *itertools.accumulate(query_lens)], dtype=torch.int64, device=device
        ),
        positions=layout.positions[index],
        slot_mapping=layout.slot_mapping[index],
        context_lens=layout.context_lens[picked],
        block_tables=layout.block_tables[picked],
        block_size=layout.block_size,
        max_query_len=max(query_lens),
        max_context_len=max(context_lens),
        is_causal_prefill=all(q == c for q, c in zip(query_lens, context_lens, strict=True)),
        is_causal=layout.is_causal,
        is_max_context_exact=layout.is_max_context_exact,
        query_lens=query_lens,
        context_lens_host=context_lens,
    )
    logits = [new_index[t] for t in logit_tokens if t in new_index]
    return ForwardInputs(
        inputs.tokens[index],
        sub,
        torch.tensor(logits, dtype=torch.int64, device=device),
        inputs.return_hidden_states,
    )
