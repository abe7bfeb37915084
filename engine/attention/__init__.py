"""Attention backends over the paged KV cache.

A backend turns a batch description into its own metadata once per step
(``build_metadata``) and then runs attention for every layer with it
(``forward``). The torch backend below works everywhere; Triton and
flash-attn backends plug in through the same two calls.
"""

from engine.attention.base import AttentionBackend, BatchLayout
from engine.attention.torch_backend import TorchAttentionBackend

__all__ = ["AttentionBackend", "BatchLayout", "TorchAttentionBackend", "get_backend"]


def get_backend(name: str = "torch") -> AttentionBackend:
    backends: dict[str, type[AttentionBackend]] = {"torch": TorchAttentionBackend}
    if name not in backends:
        raise ValueError(
            f"attention backend: {name!r} is not available; allowed: {sorted(backends)}"
        )
    return backends[name]()
