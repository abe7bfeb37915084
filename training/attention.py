"""Dense attention with autograd, so that drafts train through the very modules that serve.

Only the attention backend differs from serving; it ignores the paged caches it is handed
and keys what it keeps by the identity of each draft layer's cache tensor. One training
batch of B sequences padded to length L runs in two phases:

1. context: ``drafter.extend`` over every position, teacher-forced, with the metadata of
   ``start``. Causal attention within each sequence (EAGLE, EAGLE-3) or ``write_kv``
   (DFlash); either way each layer's K/V [B, L, Hkv, D] become the sequences' context.
2. anchored: ``drafter.propose`` for R = B * A rows; row (b, a) continues sequence b after
   its last committed position p = anchors[b, a]. A query sees the context of its sequence
   at positions <= p and the K/V its own row wrote during this propose (chain entries, or
   the DFlash block), causally by position unless the layout is non-causal: exactly what
   the paged cache holds for such a row at inference.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.attention.base import BatchLayout


@dataclass(frozen=True)
class ContextMetadata:
    """Phase 1: B sequences of L tokens each, flattened row-major."""

    num_seqs: int
    seq_len: int


@dataclass(frozen=True)
class AnchoredMetadata:
    """Phase 2: R rows of S queries each (the layout a drafter's ``propose`` builds)."""

    positions: torch.Tensor  # [R, S] int64
    is_causal: bool


Entry = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # k, v [R, S, Hkv, D]; positions [R, S]


def context_layout(num_seqs: int, seq_len: int, device: torch.device) -> BatchLayout:
    """Layout of phase 1; only ``positions`` is read by the drafters (slots are dummies)."""
    positions = torch.arange(seq_len, device=device).repeat(num_seqs)  # [B*L]
    return BatchLayout(
        input_row_offsets=torch.arange(num_seqs + 1, device=device) * seq_len,
        positions=positions,
        slot_mapping=torch.arange(num_seqs * seq_len, device=device),
        context_lens=torch.full((num_seqs,), seq_len, device=device),
        block_tables=torch.zeros((num_seqs, 1), dtype=torch.int64, device=device),
        block_size=seq_len,
        max_query_len=seq_len,
        max_context_len=seq_len,
        is_causal_prefill=True,
    )


class TrainAttentionBackend:
    """Implements the ``AttentionBackend`` protocol over dense tensors, with autograd."""

    def __init__(self) -> None:
        self._shape: tuple[int, int] = (0, 0)  # (B, L) of the current batch
        self._context: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # [B, L, Hkv, D] each
        self._entries: dict[int, list[Entry]] = {}
        self._anchors: torch.Tensor | None = None  # [B, A]

    def start(self, num_seqs: int, seq_len: int) -> ContextMetadata:
        """Forgets the previous batch; returns the metadata for phase 1."""
        self._shape = (num_seqs, seq_len)
        self._context.clear()
        self._entries.clear()
        self._anchors = None
        return ContextMetadata(num_seqs, seq_len)

    def set_anchors(self, anchors: torch.Tensor) -> None:
        """Phase 2 rows: ``anchors`` [B, A] last committed positions, row r = b * A + a."""
        self._anchors = anchors
        self._entries.clear()

    def build_metadata(self, layout: BatchLayout) -> AnchoredMetadata:
        rows = layout.input_row_offsets.numel() - 1
        return AnchoredMetadata(layout.positions.view(rows, -1), layout.is_causal)

    def write_kv(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        self._keep_context(id(k_cache), k, v)

    def _keep_context(self, key: int, k: torch.Tensor, v: torch.Tensor) -> None:
        b, n = self._shape
        self._context[key] = (k.view(b, n, *k.shape[1:]), v.view(b, n, *v.shape[1:]))

    def forward(
        self,
        q: torch.Tensor,  # [T, Hq, D]
        k: torch.Tensor,  # [T, Hkv, D]
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        metadata: ContextMetadata | AnchoredMetadata,
    ) -> torch.Tensor:  # [T, Hq, D]
        if isinstance(metadata, ContextMetadata):
            self._keep_context(id(k_cache), k, v)
            b, n = self._shape
            qs, ks, vs = (x.view(b, n, *x.shape[1:]).transpose(1, 2) for x in (q, k, v))
            out = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=True)
            return out.transpose(1, 2).reshape(q.shape)
        return self._anchored(q, k, v, id(k_cache), metadata)

    def _anchored(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        key: int,
        metadata: AnchoredMetadata,
    ) -> torch.Tensor:
        assert self._anchors is not None, "set_anchors before propose"
        ctx_k, ctx_v = self._context[key]  # [B, L, Hkv, D]
        b, n = self._shape
        a = self._anchors.shape[1]
        r, s = metadata.positions.shape
        hq, hkv, d = q.shape[1], k.shape[1], q.shape[2]
        entries = self._entries.setdefault(key, [])
        entries.append((k.view(r, s, hkv, d), v.view(r, s, hkv, d), metadata.positions))
        loc_k = torch.cat([e[0] for e in entries], dim=1)  # [R, E, Hkv, D]
        loc_v = torch.cat([e[1] for e in entries], dim=1)
        loc_pos = torch.cat([e[2] for e in entries], dim=1)  # [R, E]
        scale = d**-0.5

        # Context scores per sequence, query heads grouped by their KV head (GQA).
        qg = q.view(b, a * s, hkv, hq // hkv, d).permute(0, 2, 3, 1, 4)  # [B, Hkv, G, A*S, D]
        ck = ctx_k.transpose(1, 2)[:, :, None]  # [B, Hkv, 1, L, D]
        ctx_scores = (qg @ ck.transpose(-1, -2)) * scale  # [B, Hkv, G, A*S, L]
        is_ctx = torch.arange(n, device=q.device) <= self._anchors[:, :, None]  # [B, A, L]
        is_ctx = is_ctx.repeat_interleave(s, dim=1)[:, None, None]  # [B, 1, 1, A*S, L]
        ctx_scores = ctx_scores.masked_fill(~is_ctx, float("-inf"))

        # Scores against the row's own entries.
        ql = q.view(r, s, hkv, hq // hkv, d).permute(0, 2, 3, 1, 4)  # [R, Hkv, G, S, D]
        lk = loc_k.permute(0, 2, 1, 3)[:, :, None]  # [R, Hkv, 1, E, D]
        loc_scores = (ql @ lk.transpose(-1, -2)) * scale  # [R, Hkv, G, S, E]
        if metadata.is_causal:
            is_seen = loc_pos[:, None, :] <= metadata.positions[:, :, None]  # [R, S, E]
            loc_scores = loc_scores.masked_fill(~is_seen[:, None, None], float("-inf"))

        # One softmax over both key sets, per row: [R, Hkv, G, S, L + E].
        ctx_rows = ctx_scores.view(b, hkv, -1, a, s, n).permute(0, 3, 1, 2, 4, 5)
        scores = torch.cat([ctx_rows.reshape(r, hkv, -1, s, n), loc_scores], dim=-1)
        probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)
        p_ctx, p_loc = probs.split([n, loc_k.shape[1]], dim=-1)
        p_ctx = p_ctx.view(b, a, hkv, -1, s, n).permute(0, 2, 3, 1, 4, 5)  # [B, Hkv, G, A, S, L]
        cv = ctx_v.transpose(1, 2)[:, :, None]  # [B, Hkv, 1, L, D]
        out_ctx = p_ctx.reshape(b, hkv, -1, a * s, n) @ cv  # [B, Hkv, G, A*S, D]
        out_ctx = out_ctx.view(b, hkv, -1, a, s, d).permute(
            0, 3, 4, 1, 2, 5
        )  # [B, A, S, Hkv, G, D]
        lv = loc_v.permute(0, 2, 1, 3)[:, :, None]  # [R, Hkv, 1, E, D]
        out_loc = (p_loc @ lv).permute(0, 3, 1, 2, 4)  # [R, S, Hkv, G, D]
        return (out_ctx.reshape(r, s, hkv, -1, d) + out_loc).reshape(r * s, hq, d)
