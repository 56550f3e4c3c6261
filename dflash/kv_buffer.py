"""The preallocated KV buffer both caches are built on (the bottom layer of ``dflash``).

One tensor ``kv [L, 2, Hkv, max_len, D]`` (layers, key/value, kv heads,
positions, head dim; batch 1) and a committed ``length``. A forward of ``T``
new tokens writes rows ``[length, length + T)`` of every layer and attends
over rows ``[0, length + T)`` (views, no concatenation); the caller then keeps
what it accepted. Rows past ``length`` are scratch.
"""

from __future__ import annotations

import torch

__all__ = ["CacheFullError", "KVBuffer"]


class CacheFullError(RuntimeError):
    """A forward would write past the preallocated cache length."""


class KVBuffer:
    #: True once a fixed-shape (compiled-round) cache has moved its length to the device
    static = False

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, max_len: int, dtype, device,
                 kv: "torch.Tensor | None" = None):
        """``kv``: optional storage, a contiguous ``[L, 2, Hkv, max_len, D]`` tensor of ``dtype`` on ``device``
        (e.g. a view of a buffer several pooled rounds share, zero-filled or holding only K/V values earlier
        passes wrote: attention gives rows past a pass's keys weight 0, which needs them finite); allocated
        (zeros) when omitted."""
        shape = (num_layers, 2, num_kv_heads, int(max_len), head_dim)
        if kv is None:
            kv = torch.zeros(shape, dtype=dtype, device=device)
        else:
            want = torch.device(device)
            same_device = kv.device.type == want.type and (want.index is None or kv.device.index == want.index)
            if tuple(kv.shape) != shape or kv.dtype != dtype or not same_device or not kv.is_contiguous():
                raise ValueError(f"{type(self).__name__}: kv must be a contiguous {shape} {dtype} tensor on {want}, "
                                 f"got {tuple(kv.shape)} {kv.dtype} on {kv.device}")
        self.kv = kv
        self.max_len = int(max_len)
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

    # ------------------------------------------------- fixed-shape (compiled-round) form
    def freeze(self) -> None:
        """From now on passes are static: ``length_t [1]`` int64 on the device holds the committed length
        (and ``rows = arange(max_len)`` serves the row indices). Allocated once and reused by every later
        freeze: captured CUDA graphs hold their addresses."""
        if getattr(self, "length_t", None) is None:
            self.length_t = torch.zeros(1, dtype=torch.long, device=self.kv.device)
            self.rows = torch.arange(self.max_len, device=self.kv.device)
        self.length_t.fill_(self.length)
        self.static = True

    def thaw(self) -> None:
        """Back to an empty eager cache (the device tensors are kept for the next :meth:`freeze`)."""
        self.static = False
        self.length = 0

    def crop(self, length: int) -> None:
        """Forget everything from position ``length`` on."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot crop a cache of length {self.length} to {length}")
        self.length = int(length)
