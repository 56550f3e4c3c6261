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

from typing import Optional, Tuple

import torch

from dflash_kernels import static_ops

from .cache import DraftKVCache

__all__ = ["StaticDraftKVCache", "check_kv", "draft_kv_shape"]


def draft_kv_shape(config, max_len: int) -> Tuple[int, int, int, int, int]:
    """``(L, 2, Hkv, max_len, D)``: the shape of a drafter cache of ``max_len`` rows (as :class:`DraftKVCache`)."""
    return (config.num_hidden_layers, 2, config.num_key_value_heads, int(max_len), config.head_dim)


def check_kv(kv: torch.Tensor, shape, dtype, device, what: str) -> torch.Tensor:
    """``kv`` if it is a contiguous ``shape`` tensor of ``dtype`` on ``device`` (a buffer handed to a cache)."""
    device = torch.device(device)
    same_device = kv.device.type == device.type and (device.index is None or kv.device.index == device.index)
    if tuple(kv.shape) != tuple(shape) or kv.dtype != dtype or not same_device or not kv.is_contiguous():
        raise ValueError(f"{what}: kv must be a contiguous {tuple(shape)} {dtype} tensor on {device}, got "
                         f"{tuple(kv.shape)} {kv.dtype} on {kv.device}")
    return kv


class StaticDraftKVCache(DraftKVCache):
    """:class:`DraftKVCache` whose committed length moves to the device at :meth:`freeze`.

    ``kv``: optional storage (``[L, 2, Hkv, max_len, D]``, e.g. a view of a
    buffer several pooled rounds share; zero-filled or holding only K/V values
    earlier passes wrote). Allocated (zeros) when omitted.
    """

    #: reference backend, during a static pass: ``{window: visible [B, S] bool}`` shared by the layers
    visible = None

    def __init__(self, config, max_len: int, dtype, device, kv: Optional[torch.Tensor] = None):
        if kv is None:
            super().__init__(config, max_len, dtype, device)
            return
        self.kv = check_kv(kv, draft_kv_shape(config, max_len), dtype, device, "StaticDraftKVCache")
        self.max_len = int(max_len)
        self.length = 0

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
            static_ops.kv_write_(self.kv, layer_idx, self.length_t + self.rows[:C], k[:, :C], v[:, :C])
        static_ops.kv_write_(self.kv, layer_idx, prefix + self.rows[:B], k[:, C:], v[:, C:])
        layer = self.kv[layer_idx]
        return layer[0], layer[1], prefix

    def advance_static(self, count: torch.Tensor) -> None:
        self.length_t.add_(count)
