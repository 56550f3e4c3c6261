"""The drafter's KV cache: context K/V persist across rounds, the block's K/V are scratch."""

from __future__ import annotations

import torch

from ..kv_buffer import KVBuffer

__all__ = ["DraftKVCache"]


class DraftKVCache(KVBuffer):
    """The drafter's cache: context K/V persist; the block's K/V are scratch.

    ``update(layer, k, v, num_context=C)`` writes the new context rows and
    the block rows after the committed context and returns views over all of
    them; ``advance(C)`` (called once per pass) keeps the C context rows.
    Context row ``i`` sits at absolute position ``i``.
    """

    @staticmethod
    def kv_shape(config, max_len: int):
        """``(L, 2, Hkv, max_len, D)`` of a drafter cache of ``max_len`` rows."""
        return (config.num_hidden_layers, 2, config.num_key_value_heads, int(max_len), config.head_dim)

    def __init__(self, config, max_len: int, dtype, device, kv=None):
        layers, _, kv_heads, _, head_dim = self.kv_shape(config, max_len)
        super().__init__(layers, kv_heads, head_dim, max_len, dtype, device, kv=kv)

    def update(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor, num_context: int):
        return self.write(layer_idx, k, v)

    def positions(self, num_new_context: int) -> torch.Tensor:
        """Absolute positions of the cached context plus ``num_new_context`` new rows."""
        return torch.arange(self.length + num_new_context, device=self.kv.device)

    def advance(self, num_context: int) -> None:
        self.commit(num_context)
