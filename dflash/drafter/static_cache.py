"""The drafter's KV cache for fixed-shape (compiled / CUDA-graph) rounds: the committed length on the device.

Same storage as :class:`~dflash.drafter.cache.DraftKVCache` (``kv [L, 2, Hkv,
S, D]``), but once :meth:`freeze` has run the committed context length is
``length_t [1]`` int64 on the device and a pass never reads it on the host:

* a static pass writes ``C`` new context rows (a fixed count, of which the
  first ``count`` are real: ``count [1]`` on the device) at rows
  ``[length, length + C)`` and then the ``B`` block rows at
  ``[length + count, length + count + B)`` (they overwrite the padding rows);
* the block queries attend to rows ``[0, length + count)`` (all context) and
  the ``B`` block rows, every one visible (the drafter is not causal); rows
  past ``length + count + B`` are stale and masked by the attention;
* :meth:`advance_static` adds ``count`` to ``length_t`` (on the device).

Before :meth:`freeze` the cache behaves as the eager cache (the prompt's
context is ingested eagerly, once).
"""

from __future__ import annotations

import torch

import dflash_kernels

from .cache import DraftKVCache

__all__ = ["StaticDraftKVCache"]


class StaticDraftKVCache(DraftKVCache):
    """:class:`DraftKVCache` whose committed length moves to the device at :meth:`freeze`
    (``kv=``: caller storage, see :class:`~dflash.kv_buffer.KVBuffer`)."""

    #: reference backend, during a static pass: ``{window: visible [B, S] bool}`` shared by the layers
    visible = None

    def write_static(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor, num_context: int,
                     count: torch.Tensor):
        """Write ``k, v [Hkv, C + B, D]`` (``C = num_context`` padded context rows, then the block).

        Returns ``(k_all, v_all [Hkv, S, D], prefix [1])``: views of the whole
        layer and the number of keys before the block rows (``length + count``).
        """
        C = num_context
        B = k.shape[1] - C
        prefix = self.length_t + count
        # two writes, in stream order: the context rows (padding included) first, then the block rows, which
        # overwrite the padding rows they meet; within each write the destination rows are distinct
        if C:
            dflash_kernels.kv_write_(self.kv, layer_idx, self.length_t + self.rows[:C], k[:, :C], v[:, :C])
        dflash_kernels.kv_write_(self.kv, layer_idx, prefix + self.rows[:B], k[:, C:], v[:, C:])
        layer = self.kv[layer_idx]
        return layer[0], layer[1], prefix

    def advance_static(self, count: torch.Tensor) -> None:
        self.length_t.add_(count)
