"""The layers whose work a tensor-parallel rank shares with the others: an embedding split
by vocabulary (each rank looks up the ids it holds, the rest are zeros, and an all-reduce
adds them up), and the gather of a vocabulary-parallel LM head's logits. Column- and
row-parallel projections are plain ``Linear``s of the rank's shape (``engine.models``):
a row-parallel one's output is all-reduced by its caller, and its bias is rank 0's alone.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.parallel.group import TensorParallelGroup


class VocabParallelEmbedding(nn.Module):
    """Rows ``shard.vocab(vocab_size)`` of the embedding (``weight`` as nn.Embedding's)."""

    def __init__(self, vocab_size: int, hidden_size: int, tp: TensorParallelGroup) -> None:
        super().__init__()
        self.tp = tp
        self.vocab = tp.shard.vocab(vocab_size)
        self.weight = nn.Parameter(torch.empty(len(self.vocab), hidden_size))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        held = (tokens >= self.vocab.start) & (tokens < self.vocab.stop)
        local = torch.where(held, tokens - self.vocab.start, 0)
        x = F.embedding(local, self.weight) * held.unsqueeze(-1).to(self.weight.dtype)
        return self.tp.all_reduce(x)


def gather_logits(tp: TensorParallelGroup, logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Every rank's logits ``[N, len(shard.vocab)]`` -> the whole ``[N, vocab_size]``."""
    if tp.size == 1:
        return logits
    per_rank = -(-vocab_size // tp.size)
    if logits.shape[-1] < per_rank:  # the last rank's run is shorter
        logits = F.pad(logits, (0, per_rank - logits.shape[-1]))
    return tp.all_gather(logits, dim=-1)[..., :vocab_size]
