"""DeepSeek-V3's mixture of experts: sigmoid router with a correction bias, group-limited
top-k, routed scaling factor, shared experts."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from engine.deepseek_v3_config import DeepseekV3Config
from engine.models.layers import GatedMLP
from engine.parallel.group import TensorParallelGroup


class TopkRouter(nn.Module):
    """Picks ``num_experts_per_tok`` experts per token and their weights, in fp32.

    Scores are ``sigmoid(x @ weight.T)``. Choosing adds ``e_score_correction_bias`` (a
    load-balancing offset that never weighs an output): experts form ``n_group`` groups,
    each scored by the sum of its two best biased scores; only the ``topk_group`` best
    groups stay, and the top-k experts are chosen among theirs. Weights are the unbiased
    scores of the chosen experts, normalised to sum to 1 (``norm_topk_prob``), times
    ``routed_scaling_factor``.
    """

    def __init__(self, config: DeepseekV3Config) -> None:
        super().__init__()
        self.num_experts = config.n_routed_experts
        self.top_k = config.num_experts_per_tok
        self.num_groups, self.topk_group = config.n_group, config.topk_group
        self.norm_topk_prob = config.norm_topk_prob
        self.routed_scaling_factor = config.routed_scaling_factor
        # fp32 whatever the model's dtype (``keep_fp32``); a parameter so the loader fills it.
        self.weight = nn.Parameter(torch.empty(self.num_experts, config.hidden_size))
        self.e_score_correction_bias = nn.Parameter(
            torch.zeros(self.num_experts), requires_grad=False
        )

    def keep_fp32(self) -> None:
        """Back to fp32 after the model was cast to its dtype (before weights load)."""
        self.weight.data = self.weight.data.float()
        self.e_score_correction_bias.data = self.e_score_correction_bias.data.float()

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] -> (expert ids [T, k] int64, weights [T, k] fp32)."""
        scores = F.linear(x.float(), self.weight.float()).sigmoid()  # [T, E]
        biased = scores + self.e_score_correction_bias
        per_group = biased.view(-1, self.num_groups, self.num_experts // self.num_groups)
        group_scores = per_group.topk(2, dim=-1).values.sum(dim=-1)  # [T, G]
        groups = group_scores.topk(self.topk_group, dim=-1, sorted=False).indices
        kept = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, groups, True)
        kept = kept.unsqueeze(-1).expand_as(per_group).reshape(-1, self.num_experts)
        biased = biased.masked_fill(~kept, float("-inf"))
        ids = biased.topk(self.top_k, dim=-1, sorted=False).indices  # [T, k]
        weights = scores.gather(1, ids)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return ids, weights * self.routed_scaling_factor


@dataclass
class DataParallelStep:
    """One step of data-parallel attention (``EngineConfig.data_parallel_size``): how many
    tokens, and how many rows of logits, each rank of ``group`` runs, in rank order. The
    executor sets them before every forward; each rank's experts then see every rank's
    tokens (``gather_rows``) and hand each rank back its own (``own_rows``)."""

    group: TensorParallelGroup
    # The seed's name: the batch's rows each rank owns, per rank, in rank order.
    data_parallel_splits: list[list[int]] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)  # per rank: its rows' tokens
    logits: list[int] = field(default_factory=list)  # per rank: its rows' rows of logits

    # Opaque to torch.compile (a graph break, as the experts' loop is): traced, the counts
    # would be guarded on, and every new split of the rows would compile again.
    @torch.compiler.disable
    def gather_rows(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """Every rank's ``counts[r]`` rows of ``x``, concatenated in rank order, on every
        rank: one all-gather of the rows padded to the most any rank has."""
        most = max(counts)
        if most == 0:
            return x
        if x.shape[0] < most:
            x = torch.cat([x, x.new_zeros(most - x.shape[0], *x.shape[1:])])
        everyone = self.group.all_gather(x.contiguous(), dim=0)  # [size * most, ...]
        return torch.cat([everyone[r * most : r * most + n] for r, n in enumerate(counts)])

    @torch.compiler.disable
    def own_rows(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """This rank's rows of ``x`` (every rank's ``counts`` of rows, in rank order)."""
        start = sum(counts[: self.group.shard.rank])
        return x[start : start + counts[self.group.shard.rank]]


class DeepseekV3MoE(nn.Module):
    """Routed experts weighted by the router, plus shared experts every token goes through.

    Split over ranks (``tp``), every rank routes the same tokens and the rank's partial
    output is all-reduced once, after the shared experts:

    - **Tensor parallel** (default): every expert's intermediate channels are split, as a
      dense MLP's are; each rank runs every chosen expert on its channels.
    - **Expert parallel** (``config.expert_parallel``): the routed experts are split whole,
      ``n_routed_experts / size`` a rank (``expert_ids``); each rank runs the chosen experts
      it holds. The shared experts stay tensor-parallel: their partial sums ride the same
      all-reduce, so expert parallelism adds no collective.

    Under data-parallel attention (``dp``) each rank brings its own tokens: they are
    gathered from every rank first, and each rank keeps its own rows of the sum.
    """

    def __init__(
        self,
        config: DeepseekV3Config,
        tp: TensorParallelGroup | None = None,
        dp: DataParallelStep | None = None,
    ) -> None:
        super().__init__()
        self.tp = tp or TensorParallelGroup.single()
        self.dp = dp
        shard = self.tp.shard
        inter = config.moe_intermediate_size
        self.gate = TopkRouter(config)
        if config.expert_parallel:
            self.expert_ids = shard.even(config.n_routed_experts, "n_routed_experts")
            expert_inter = inter
        else:
            self.expert_ids = range(config.n_routed_experts)
            expert_inter = len(shard.even(inter, "moe_intermediate_size"))
        self.experts = nn.ModuleList(
            GatedMLP(config.hidden_size, expert_inter, bias=False) for _ in self.expert_ids
        )
        shared = inter * config.n_shared_experts
        self.shared_experts = (
            GatedMLP(config.hidden_size, len(shard.even(shared, "shared experts' size")), False)
            if config.n_shared_experts
            else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, H] -> [T, H]
        if self.dp is None:
            return self.combined(x)
        everyone = self.dp.gather_rows(x, self.dp.tokens)
        return self.dp.own_rows(self.combined(everyone), self.dp.tokens)

    def combined(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's partial output over the same tokens, all-reduced."""
        ids, weights = self.gate(x)
        out = torch.zeros_like(x)
        first, last = self.expert_ids.start, self.expert_ids.stop
        # Experts in ascending id, each over the tokens that chose it (as transformers sums).
        for expert in ids.unique().tolist():
            if not first <= expert < last:
                continue  # another rank's
            tokens, slot = torch.where(ids == expert)
            y = self.experts[expert - first](x[tokens]) * weights[tokens, slot, None]  # fp32
            # Each token once per expert: a gather and a put (index_add_ took 3.5 ms for
            # 3 rows on this CPU, about 200 times longer).
            out[tokens] = out[tokens] + y.to(out.dtype)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return self.tp.all_reduce(out)
