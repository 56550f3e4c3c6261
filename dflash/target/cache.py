"""The target's preallocated KV cache, as Hugging Face attention modules call it.

Storage and lengths as :class:`~dflash.cache.KVBuffer` (``kv [L, 2, Hkv,
max_len, D]`` per sequence, ``kv_batched [b, ...]`` for a batch, ``length_t
[b]`` on the device, the host mirrors). HF attention calls
``cache.update(key, value, layer_idx, ...)`` with ``key [b, Hkv, T, D]``:

* an eager pass (the prefill; one sequence, ``b = 1``) writes rows ``[length,
  length + T)`` and gets ``[1, Hkv, length + T, D]`` views; :meth:`commit`
  keeps them;
* a round pass (after :meth:`freeze`) writes sequence ``r``'s rows at
  ``length_t[r] + arange(T)`` by index (:func:`dflash_kernels.kv_write_`)
  and gets the WHOLE layer ``[b, Hkv, S, D]``; the attention masks every key
  past ``length_t[r] + T``. The round commits on the device: :meth:`advance`
  (``length_t += n``: the DFlash chain's ``a + 1`` rows, an AR step's 1) or
  :meth:`compact_advance` (the DDTree path's rows moved to follow the prefix
  by one compaction launch over every layer and sequence, then ``length_t +=
  path_len``).

Rows past the committed length are scratch: the next pass overwrites them.
"""

from __future__ import annotations

import torch

import dflash_kernels

from ..cache import CacheFullError, KVBuffer
from .families import config_value

__all__ = ["CacheFullError", "TargetKVCache"]


class TargetKVCache(KVBuffer):
    """The target's cache, duck-typed for Hugging Face attention modules (``kv=``: caller storage)."""

    @staticmethod
    def kv_shape(config, max_len: int, geometry=None):
        """``(L, 2, Hkv, max_len, D)`` of a target cache of ``max_len`` rows. ``geometry``: each layer's ``(Hkv_l,
        Dk_l, Dv_l)`` when they differ (the adapter's ``spec.kv_geometry``): ``Hkv`` and ``D`` are then their
        maxima (see :class:`~dflash.cache.KVBuffer`)."""
        if geometry is not None:
            return (len(geometry), 2, max(g[0] for g in geometry), int(max_len),
                    max(max(g[1:]) for g in geometry))
        head_dim = config_value(config, "head_dim") or config.hidden_size // config.num_attention_heads
        kv_heads = config_value(config, "num_key_value_heads") or config.num_attention_heads
        return (config.num_hidden_layers, 2, kv_heads, int(max_len), head_dim)

    def __init__(self, config, max_len: int, dtype, device, kv=None, batch: int = 1, geometry=None,
                 kv_layers=None):
        """``geometry``, ``kv_layers``: the adapter's ``spec.kv_geometry`` / ``spec.kv_layers`` (the layers that keep
        K/V, one slot each, and their shapes; None: a slot per layer, the config's geometry)."""
        layers, _, kv_heads, _, head_dim = self.kv_shape(config, max_len, geometry)
        super().__init__(layers, kv_heads, head_dim, max_len, dtype, device, kv=kv, batch=batch, geometry=geometry)
        self._slots = None if kv_layers is None else {layer: s for s, layer in enumerate(kv_layers)}

    def kv_slot(self, layer_idx: int) -> int:
        """The ``kv`` slot of decoder layer ``layer_idx`` (its index, or its place among the layers that keep K/V:
        Gemma 4's KV-sharing layers keep none)."""
        return layer_idx if self._slots is None else self._slots[layer_idx]

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        slot = self.kv_slot(layer_idx)
        if self.static:
            T = key_states.shape[-2]
            dest = self.pass_dest if self.pass_dest is not None and self.pass_dest.shape[-1] == T else None
            return self.write_rows(slot, key_states, value_states, self.length_t, self.key_rows(T), dest=dest)
        if key_states.shape[0] != 1:
            raise ValueError(f"an eager pass (the prefill) runs one sequence at a time (a batch prefills row by row "
                             f"through cache.row(r)), got key states {tuple(key_states.shape)}")
        k, v = self.write(slot, key_states[0], value_states[0])
        return k[None], v[None]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        if self.static:
            raise RuntimeError("a frozen cache keeps its length on the device (length_t); get_seq_length would "
                               "read it on the host")
        return self.length

    # ------------------------------------------------------------ a round's commit (device counts)
    def advance(self, rows: torch.Tensor, count: torch.Tensor) -> None:
        """Keep the first ``count [b]`` (device) rows of each sequence's last round pass, whose rows are ``rows
        [T]`` (``arange(T)``: a chain). K/V rows stay where they were written."""
        self.length_t.add_(count)

    def compact_advance(self, rows: torch.Tensor, count: torch.Tensor) -> None:
        """Keep each sequence's last round pass rows ``rows[r, :count[r]]`` (relative to ``length_t[r]``,
        increasing; ``rows [b, A]`` int64 and ``count [b]`` on the device; a count of 0 keeps nothing): one
        compaction over every layer and sequence moves row ``rows[r, i]`` to ``length_t[r] + i``, then
        ``length_t += count``. Entries of ``rows`` past ``count`` are ignored. One sequence may pass ``rows [A]``."""
        if rows.dim() == 1:
            rows = rows[None]
        if rows.dim() != 2 or rows.shape[0] != self.batch:
            raise ValueError(f"compact_advance: rows must be [b, A] with b = {self.batch} (or [A] for one sequence), "
                             f"got {tuple(rows.shape)}")
        start = self.length_t
        if self.batch == 1:
            dflash_kernels.compact_kv_(self.kv, rows[0] + start, start, num_rows=count, check=False)
        else:
            dflash_kernels.compact_kv_(self.kv_batched, rows + start[:, None], start, num_rows=count, check=False)
        self.length_t.add_(count)

