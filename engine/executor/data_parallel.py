"""One step under data-parallel attention, on each rank: the step's whole batch arrives
(rank 0's message, ``ForwardInputs.dp_ranks`` naming each row's rank), and each rank runs
its own rows over its own KV pool. ``data_parallel_splits`` keeps the seed's meaning:
which rows each rank owns, here as the tokens and logit rows of each rank, in rank order
(``DataParallelStep``), set before the forward so that the experts can gather every
rank's tokens. A rank with no rows joins the collectives all the same (``idle_pass``).

Every rank ends with every rank's logits, and every rank's hidden states where the
forward asks for them (a draft's features, ``engine.spec.dp_draft``), in rank order;
``forward`` puts them back in the batch's order.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Callable

import torch

from engine.attention.base import BatchLayout
from engine.executor.inputs import ForwardInputs
from engine.models.llama3 import ModelOutputs, ReturnHiddenStates
from engine.models.moe import DataParallelStep


def forward(
    inputs: ForwardInputs,
    dp: DataParallelStep,
    run: Callable[[ForwardInputs], ModelOutputs],  # this rank's rows, on one device
    idle: Callable[[ReturnHiddenStates], ModelOutputs],  # no rows: zero-row outputs
) -> ModelOutputs:
    """This rank's part of the step; the logits of every row that gets some, and the hidden
    states asked for of every token, in the batch's order."""
    assert inputs.dp_ranks is not None
    # A listened forward (a prefill worker's) is told of its layers after it returns: each
    # rank writes every layer's KV before the logits' gather (engine.model_runner).
    row_ranks = inputs.dp_ranks.tolist()
    query_lens, _ = host_lens(inputs.layout)
    offsets = [0, *itertools.accumulate(query_lens)]
    logit_tokens = inputs.logit_indices.tolist()
    logit_ranks = [row_ranks[bisect.bisect_right(offsets, t) - 1] for t in logit_tokens]
    size, me = dp.group.size, dp.group.shard.rank
    dp.data_parallel_splits = [[row for row, r in enumerate(row_ranks) if r == k]
                               for k in range(size)]  # fmt: skip
    dp.tokens = [sum(query_lens[row] for row in rows) for rows in dp.data_parallel_splits]
    dp.logits = [logit_ranks.count(k) for k in range(size)]
    mine = dp.data_parallel_splits[me]
    if mine:
        out = run(cut_rows(inputs, mine, logit_tokens)[0])
    else:
        out = idle(inputs.return_hidden_states)
    device = out.logits.device
    order = torch.tensor(batch_order(logit_ranks, size), dtype=torch.int64, device=device)
    out.logits = out.logits[order]
    if out.hidden_states or out.final_hidden_state is not None:
        token_ranks = [r for r, n in zip(row_ranks, query_lens, strict=True) for _ in range(n)]
        at = torch.tensor(batch_order(token_ranks, size), dtype=torch.int64, device=device)

        def everyone(x: torch.Tensor) -> torch.Tensor:  # every rank's tokens, batch order
            return dp.gather_rows(x, dp.tokens)[at]

        # In one order on every rank (a rank with rows and an idle one list them apart).
        out.hidden_states = {i: everyone(out.hidden_states[i]) for i in sorted(out.hidden_states)}
        if out.final_hidden_state is not None:
            out.final_hidden_state = everyone(out.final_hidden_state)
    return out


def batch_order(item_ranks: list[int], size: int) -> list[int]:
    """Where each item (in the batch's order, ``item_ranks[i]`` its rank's) sits in what
    every rank gathered, rank-major: the j-th item of rank k at ``start[k] + j``."""
    start = [0] * (size + 1)
    for rank in item_ranks:
        start[rank + 1] += 1
    start = list(itertools.accumulate(start))
    seen = [0] * size
    order = []
    for rank in item_ranks:
        order.append(start[rank] + seen[rank])
        seen[rank] += 1
    return order


def host_lens(layout: BatchLayout) -> tuple[list[int], list[int]]:
    """Each row's query and context lengths on the host (read from the device where the
    layout has no host copy: data-parallel steps run eagerly)."""
    query_lens = layout.query_lens
    if query_lens is None:
        query_lens = layout.input_row_offsets.diff().tolist()
    context_lens = layout.context_lens_host
    if context_lens is None:
        context_lens = layout.context_lens.tolist()
    return query_lens, context_lens


def cut_rows(
    inputs: ForwardInputs, rows: list[int], logit_tokens: list[int]
) -> tuple[ForwardInputs, torch.Tensor]:
    """``inputs`` cut down to ``rows`` (their tokens, KV slots, block tables and logits),
    and which of its tokens they keep ([t] int64, in order)."""
    layout = inputs.layout
    query_lens_all, context_lens_all = host_lens(layout)
    offsets = [0, *itertools.accumulate(query_lens_all)]
    device = inputs.tokens.device
    kept = [t for row in rows for t in range(offsets[row], offsets[row + 1])]
    new_index = {t: i for i, t in enumerate(kept)}
    index = torch.tensor(kept, dtype=torch.int64, device=device)
    picked = torch.tensor(rows, dtype=torch.int64, device=device)
    query_lens = [query_lens_all[r] for r in rows]
    context_lens = [context_lens_all[r] for r in rows]
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
        # A bound stays the layout's (a speculative step's reaches past its rows' lengths).
        max_context_len=(
            max(context_lens) if layout.is_max_context_exact else layout.max_context_len
        ),
        is_causal_prefill=all(q == c for q, c in zip(query_lens, context_lens, strict=True)),
        is_causal=layout.is_causal,
        is_max_context_exact=layout.is_max_context_exact,
        query_lens=query_lens,
        context_lens_host=context_lens,
    )
    logits = [new_index[t] for t in logit_tokens if t in new_index]
    cut = ForwardInputs(
        inputs.tokens[index],
        sub,
        torch.tensor(logits, dtype=torch.int64, device=device),
        inputs.return_hidden_states,
    )
    return cut, index
