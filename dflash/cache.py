"""Preallocated KV caches: the target's (crop / compaction) and the drafter's.

Both keep one tensor ``kv [L, 2, Hkv, max_len, D]`` (layers, key/value, kv
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

from typing import Optional, Sequence

import torch


class CacheFullError(RuntimeError):
    """A forward would write past the preallocated cache length."""


class _KVBuffer:
    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, max_len: int, dtype, device):
        self.kv = torch.zeros(num_layers, 2, num_kv_heads, max_len, head_dim, dtype=dtype, device=device)
        self.max_len = max_len
        self.length = 0

    def _check_room(self, new: int) -> None:
        if self.length + new > self.max_len:
            raise CacheFullError(
                f"KV cache holds {self.max_len} positions; {self.length} are used and {new} more were written. "
                "Allocate a longer cache (max_len >= prompt + max_new_tokens + block/tree size)."
            )

    def write(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor):
        """Write ``k, v [Hkv, T, D]`` at ``[length, length+T)``; return views over ``[0, length+T)``."""
        T = k.shape[-2]
        self._check_room(T)
        end = self.length + T
        layer = self.kv[layer_idx]
        layer[0, :, self.length : end].copy_(k)
        layer[1, :, self.length : end].copy_(v)
        return layer[0, :, :end], layer[1, :, :end]

    def commit(self, n: int) -> None:
        """Keep the first ``n`` rows written after ``length``."""
        self._check_room(n)
        self.length += int(n)

    def crop(self, length: int) -> None:
        """Forget everything from position ``length`` on."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot crop a cache of length {self.length} to {length}")
        self.length = int(length)


class TargetKVCache(_KVBuffer):
    """The target's static cache, duck-typed for Hugging Face attention modules.

    HF attention calls ``cache.update(key, value, layer_idx, ...)`` with
    ``key [1, Hkv, T, D]`` (batch 1); we return ``[1, Hkv, length+T, D]`` views.
    """

    def __init__(self, config, max_len: int, dtype, device):
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        super().__init__(config.num_hidden_layers, kv_heads, head_dim, max_len, dtype, device)

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        k, v = self.write(layer_idx, key_states[0], value_states[0])
        return k[None], v[None]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.length

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
        dflash_kernels.compact_kv_(self.kv, src, self.length)
        self.length += n


class DraftKVCache(_KVBuffer):
    """The drafter's cache: context K/V persist; the block's K/V are scratch.

    ``update(layer, k, v, num_context=C)`` writes the new context rows and
    the block rows after the committed context and returns views over all of
    them; ``advance(C)`` (called once per pass) keeps the C context rows.
    Context row ``i`` sits at absolute position ``i``.
    """

    def __init__(self, config, max_len: int, dtype, device):
        super().__init__(config.num_hidden_layers, config.num_key_value_heads, config.head_dim, max_len, dtype, device)

    def update(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor, num_context: int):
        return self.write(layer_idx, k, v)

    def positions(self, num_new_context: int) -> torch.Tensor:
        """Absolute positions of the cached context plus ``num_new_context`` new rows."""
        return torch.arange(self.length + num_new_context, device=self.kv.device)

    def advance(self, num_context: int) -> None:
        self.commit(num_context)
