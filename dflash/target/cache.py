"""The target's preallocated KV cache, as Hugging Face attention modules call it.

Storage and lengths as :class:`~dflash.cache.KVBuffer` (``kv [L, 2, Hkv,
max_len, D]``, ``length_t [1]`` on the device, the host mirror ``length``).
HF attention calls ``cache.update(key, value, layer_idx, ...)`` with ``key
[1, Hkv, T, D]`` (batch 1):

* an eager pass (the prefill) writes rows ``[length, length + T)`` and gets
  ``[1, Hkv, length + T, D]`` views; :meth:`commit` keeps them;
* a round pass (after :meth:`freeze`) writes rows ``length_t + arange(T)`` by
  index (:func:`dflash_kernels.kv_write_`) and gets the WHOLE
  layer ``[1, Hkv, S, D]``; the attention masks every key past
  ``length_t + T``. The round commits on the device:
  :meth:`advance` (``length_t += n``: the DFlash chain's ``a + 1`` rows, an
  AR step's 1) or :meth:`compact_advance` (the DDTree path's rows moved to
  follow the prefix by one :func:`dflash_kernels.compact_kv_`
  launch over every layer, then ``length_t += path_len``).

Rows past the committed length are scratch: the next pass overwrites them.
"""

from __future__ import annotations

import torch

import dflash_kernels

from ..cache import CacheFullError, KVBuffer

__all__ = ["CacheFullError", "TargetKVCache"]


class TargetKVCache(KVBuffer):
    """The target's cache, duck-typed for Hugging Face attention modules (``kv=``: caller storage)."""

    @staticmethod
    def kv_shape(config, max_len: int):
        """``(L, 2, Hkv, max_len, D)`` of a target cache of ``max_len`` rows."""
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        return (config.num_hidden_layers, 2, kv_heads, int(max_len), head_dim)

    def __init__(self, config, max_len: int, dtype, device, kv=None):
        layers, _, kv_heads, _, head_dim = self.kv_shape(config, max_len)
        super().__init__(layers, kv_heads, head_dim, max_len, dtype, device, kv=kv)

    def kv_slot(self, layer_idx: int) -> int:
        """The ``kv`` slot of decoder layer ``layer_idx`` (every layer has one here)."""
        return layer_idx

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        slot = self.kv_slot(layer_idx)
        if self.static:
            T = key_states.shape[-2]
            k, v = self.write_rows(slot, key_states[0], value_states[0], self.length_t, self.key_rows(T))
        else:
            k, v = self.write(slot, key_states[0], value_states[0])
        return k[None], v[None]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        if self.static:
            raise RuntimeError("a frozen cache keeps its length on the device (length_t); get_seq_length would "
                               "read it on the host")
        return self.length

    # ------------------------------------------------------------ a round's commit (device counts)
    def advance(self, rows: torch.Tensor, count: torch.Tensor) -> None:
        """Keep the first ``count [1]`` (device) rows of the last round pass, whose rows are ``rows [T]``
        (``arange(T)``: a chain). K/V rows stay where they were written."""
        self.length_t.add_(count)

    def compact_advance(self, rows: torch.Tensor, count: torch.Tensor) -> None:
        """Keep the last round pass's rows ``rows[:count]`` (relative to ``length_t``, increasing; ``rows [A]``
        int64 and ``count [1]`` on the device): one compaction over every layer moves row ``rows[i]`` to
        ``length_t + i``, then ``length_t += count``. Rows of ``rows`` past ``count`` are ignored."""
        start = self.length_t
        dflash_kernels.compact_kv_(self.kv, rows + start, start, num_rows=count, check=False)
        self.length_t.add_(count)

