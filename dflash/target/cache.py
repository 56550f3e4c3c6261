"""The target's preallocated KV cache (crop / compaction).

It keeps one tensor ``kv [L, 2, Hkv, max_len, D]`` (layers, key/value, kv
heads, positions, head dim; batch 1) and a committed ``length``. A forward of
``T`` new tokens writes rows ``[length, length + T)`` of every layer and
attends over rows ``[0, length + T)`` (views, no concatenation); the caller
then keeps what it accepted:

* DFlash chain: ``commit(a + 1)`` keeps the first ``a + 1`` rows;
* DDTree: ``commit_rows(node_indices)`` moves the accepted tree rows to be
  contiguous after the prefix (one compaction launch over all layers) and
  keeps them.

Rows past ``length`` are scratch: the next forward overwrites them.
"""

from __future__ import annotations

import torch

from ..kv_buffer import CacheFullError, KVBuffer

__all__ = ["CacheFullError", "TargetKVCache"]


class TargetKVCache(KVBuffer):
    """The target's static cache, duck-typed for Hugging Face attention modules.

    HF attention calls ``cache.update(key, value, layer_idx, ...)`` with
    ``key [1, Hkv, T, D]`` (batch 1); we return ``[1, Hkv, length+T, D]`` views.
    """

    @staticmethod
    def kv_shape(config, max_len: int):
        """``(L, 2, Hkv, max_len, D)`` of a target cache of ``max_len`` rows."""
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        return (config.num_hidden_layers, 2, kv_heads, int(max_len), head_dim)

    def __init__(self, config, max_len: int, dtype, device, kv=None):
        layers, _, kv_heads, _, head_dim = self.kv_shape(config, max_len)
        super().__init__(layers, kv_heads, head_dim, max_len, dtype, device, kv=kv)

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        k, v = self.write(layer_idx, key_states[0], value_states[0])
        return k[None], v[None]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.length

    def compact_rows(self, rows: torch.Tensor, num_rows: torch.Tensor) -> None:
        """Move written rows ``rows[i]`` (relative to ``length``) to ``length + i`` for ``i < num_rows``.

        ``rows [A]`` int64 and ``num_rows [1]`` live on the cache's device (the
        DDTree walk's padded path and its length): one
        :func:`dflash_kernels.compact_kv_` launch over every layer, no host
        read. The caller then commits the count once it has read it.
        """
        import dflash_kernels

        self._check_room(rows.numel())
        dflash_kernels.compact_kv_(self.kv, rows + self.length, self.length, num_rows=num_rows, check=False)

    def commit_rows(self, rows: torch.Tensor) -> None:
        """Keep written rows ``rows`` (int64, increasing, relative to ``length``) and compact them.

        Row ``rows[i]`` moves to ``length + i`` in every layer (one launch of
        :func:`dflash_kernels.compact_kv_`), then ``length += len(rows)``.
        """
        import dflash_kernels

        n = int(rows.numel())
        self._check_room(n)
        # host positions: compact_kv_ validates them without a device->host sync
        src = rows.detach().to(device="cpu", dtype=torch.long) + self.length
        dflash_kernels.compact_kv_(self.kv, src, self.length, check=False)  # rows from our own walk
        self.length += n
