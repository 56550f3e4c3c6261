"""The preallocated KV buffer both caches are built on, with its committed length on the device.

One tensor ``kv [L, 2, Hkv, max_len, D]`` (layers, key/value, kv heads,
positions, head dim; batch 1), the committed length ``length_t [1]`` int64 on
the device and its host mirror ``length``. Two kinds of pass write to it:

* an **eager** pass (the prompt's prefill; shapes vary with the prompt) of
  ``T`` rows writes rows ``[length, length + T)`` and attends over the views
  ``[0, length + T)``; :meth:`commit` then keeps what the caller accepted and
  moves both lengths on;
* a **round** pass (after :meth:`freeze`; shapes fixed, nothing read on the
  host, so the same code runs eagerly, compiled and captured) writes its
  rows at ``length_t + arange(T)`` (:meth:`write_rows`) and attends over the
  whole layer ``[0, max_len)``, masking every key past ``length_t + T``. The
  round moves ``length_t`` on the device; the host loop refreshes the mirror
  from the round's one read (:meth:`mirror`).

Rows past the committed length are scratch: the next pass overwrites them.
"""

from __future__ import annotations

import torch

import dflash_kernels

__all__ = ["CacheFullError", "KVBuffer"]


class CacheFullError(RuntimeError):
    """A pass would write past the preallocated cache length."""


class KVBuffer:
    """See the module docstring. ``kv``: optional caller storage (e.g. a view of a buffer pooled rounds share)."""

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, max_len: int, dtype, device,
                 kv: "torch.Tensor | None" = None):
        """``kv``: a contiguous ``[L, 2, Hkv, max_len, D]`` tensor of ``dtype`` on ``device``, zero-filled or
        holding only K/V values earlier passes wrote (attention gives rows past a pass's keys weight 0,
        which needs them finite); allocated (zeros) when omitted."""
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
        #: host mirror of the committed length (exact between rounds; a round pass never reads it)
        self.length = 0
        #: the committed length on the device, read and moved by round passes
        self.length_t = torch.zeros(1, dtype=torch.long, device=kv.device)
        #: ``arange(max_len)``: row offsets of a round pass's writes
        self.rows = torch.arange(self.max_len, device=kv.device)
        #: True between :meth:`freeze` and :meth:`thaw`: passes are round passes
        self.static = False
        #: eager round passes: attend over the rows the host mirror says can be visible (``length + T``), not
        #: the whole cache (a traced round, whose shapes may not change, sets this False)
        self.key_bound = True

    def _check_room(self, new: int) -> None:
        if self.length + new > self.max_len:
            raise CacheFullError(
                f"KV cache holds {self.max_len} positions; {self.length} are used and {new} more were written. "
                "Allocate a longer cache (max_len >= prompt + max_new_tokens + block/tree size)."
            )

    # ------------------------------------------------- eager passes (the prefill)
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
        """Keep the first ``n`` rows written after ``length`` (both lengths move)."""
        self._check_room(n)
        self.length += int(n)
        self.length_t.fill_(self.length)

    def crop(self, length: int) -> None:
        """Forget everything from position ``length`` on."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot crop a cache of length {self.length} to {length}")
        self.length = int(length)
        self.length_t.fill_(self.length)

    # ------------------------------------------------- round passes
    def key_rows(self, new: int) -> int:
        """Rows a round pass writing ``new`` rows past the committed ones attends over: the whole cache
        (``max_len``, fixed: traced rounds), or with :attr:`key_bound` the ``length + new`` the host mirror
        bounds them by (keys past them are masked either way, so both give the same attention)."""
        return min(self.max_len, self.length + int(new)) if self.key_bound else self.max_len

    def write_rows(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor, start: torch.Tensor, keys: int):
        """Write ``k, v [Hkv, T, D]`` at rows ``start + arange(T)`` (``start [1]`` on the device; the rows are
        distinct, so the scatter has no overlap); return the layer's first ``keys`` rows ``(k, v) [Hkv, keys,
        D]`` (:meth:`key_rows`)."""
        T = k.shape[-2]
        dflash_kernels.kv_write_(self.kv, layer_idx, start + self.rows[:T], k, v)
        layer = self.kv[layer_idx]
        return layer[0, :, :keys], layer[1, :, :keys]

    def freeze(self) -> None:
        """From now on passes are round passes (``length_t`` holds the committed length)."""
        self.length_t.fill_(self.length)
        self.static = True

    def mirror(self, length: int) -> None:
        """Refresh the host mirror from a value the round's one read brought back (no device access)."""
        self.length = int(length)

    def thaw(self) -> None:
        """Back to an empty cache for the next prefill (the buffers are kept: captured graphs hold them)."""
        self.static = False
        self.length = 0
        self.length_t.zero_()
