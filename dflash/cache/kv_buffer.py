"""The preallocated KV buffer both caches are built on, with its committed length on the device.

One tensor ``kv [L, 2, Hkv, max_len, D]`` (layers, key/value, kv heads,
positions, head dim) per sequence; the storage of ``b`` sequences (one is a batch of one) is one
contiguous ``kv_batched [b, L, 2, Hkv, max_len, D]`` (``kv`` is its row 0 when
``b == 1``; storage handed in for one sequence may omit the batch axis). The committed lengths ``length_t [b]`` int64 live on the device,
their host mirrors in ``lengths`` (``length``: their maximum, what bounds the
keys a pass reads). Two kinds of pass write to it:

* an **eager** pass (the prompt's prefill; shapes vary with the prompt) of
  ``T`` rows writes rows ``[length, length + T)`` and attends over the views
  ``[0, length + T)``; :meth:`commit` then keeps what the caller accepted and
  moves both lengths on;
  A batch is prefilled row by row, each row through its own one-sequence
  view (:meth:`row`), then :meth:`take_lengths` gathers the rows' lengths;
* a **round** pass (after :meth:`freeze`; shapes fixed, nothing read on the
  host, so the same code runs eagerly, compiled and captured) writes row
  ``r``'s ``T`` rows at ``length_t[r] + arange(T)`` (:meth:`write_rows`) and
  attends over the whole layer ``[0, max_len)``, masking every key past
  ``length_t[r] + T``. The round moves ``length_t`` on the device; the host
  loop refreshes the mirrors from the round's one read (:meth:`mirror`).

Rows past the committed length are scratch: the next pass overwrites them.
"""

from __future__ import annotations

import copy
from typing import Optional

import torch

import dflash_kernels

__all__ = ["CacheFullError", "KVBuffer"]


class CacheFullError(RuntimeError):
    """A pass would write past the preallocated cache length."""


class KVBuffer:
    """See the module docstring. ``kv``: optional caller storage (e.g. a view of a buffer pooled rounds share)."""

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, max_len: int, dtype, device,
                 kv: "torch.Tensor | None" = None, batch: int = 1, geometry=None):
        """``kv``: a contiguous ``[L, 2, Hkv, max_len, D]`` tensor (``batch == 1``) or ``[batch, L, 2, Hkv, max_len,
        D]`` of ``dtype`` on ``device``, zero-filled or holding only K/V values earlier passes wrote (attention
        gives rows past a pass's keys weight 0, which needs them finite); allocated (zeros) when omitted.

        ``geometry``: ``[(Hkv_l, Dk_l, Dv_l)]`` per slot when the layers' K/V differ in shape (Gemma 4's global
        layers, MiMo-V2-Flash's sliding ones and its value heads); then ``Hkv`` / ``D`` are their maxima and slot
        ``l``'s keys live in the corner ``[:Hkv_l, :, :Dk_l]`` of its ``[Hkv, S, D]``, its values in ``[:Hkv_l, :,
        :Dv_l]`` (zeros elsewhere, never read). None: every slot is ``(Hkv, D, D)``, the plain layout."""
        if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
            raise ValueError(f"{type(self).__name__}: batch must be an int >= 1, got {batch!r}")
        if geometry is not None:
            geometry = [(int(g[0]), int(g[1]), int(g[-1])) for g in geometry]
            if len(geometry) != num_layers or any(h > num_kv_heads or max(dk, dv) > head_dim
                                                  for h, dk, dv in geometry):
                raise ValueError(f"{type(self).__name__}: geometry must give {num_layers} (Hkv, Dk, Dv) within "
                                 f"({num_kv_heads}, {head_dim}), got {geometry}")
            if all(g == (num_kv_heads, head_dim, head_dim) for g in geometry):
                geometry = None  # one geometry: the plain layout, no views
        #: ``[(Hkv_l, Dk_l, Dv_l)]`` of each slot when they differ (None: one geometry, the whole ``[Hkv, S, D]``)
        self.geometry = geometry
        shape = (num_layers, 2, num_kv_heads, int(max_len), head_dim)
        full = (batch,) + shape
        if kv is None:
            kv = torch.zeros(full, dtype=dtype, device=device)
        else:
            want = torch.device(device)
            same_device = kv.device.type == want.type and (want.index is None or kv.device.index == want.index)
            if batch == 1 and tuple(kv.shape) == shape:  # one sequence's storage, given without its batch axis
                kv = kv[None]
            if tuple(kv.shape) != full or kv.dtype != dtype or not same_device or not kv.is_contiguous():
                raise ValueError(f"{type(self).__name__}: kv must be a contiguous {full} {dtype} tensor on {want} "
                                 f"(with one sequence also {shape}), got {tuple(kv.shape)} {kv.dtype} on {kv.device}")
        #: ``[b, L, 2, Hkv, max_len, D]``: every sequence's storage (row ``r`` is ``kv_batched[r]``); after
        #: :meth:`narrow`, the first rows of the whole storage
        self.kv_batched = kv
        self._kv_whole = self.kv_batched
        self.batch = batch
        self.max_len = int(max_len)
        #: host mirrors of the committed lengths, one per sequence (exact between rounds; passes never read them)
        self.lengths = [0] * batch
        #: the committed lengths on the device, read and moved by round passes
        self.length_t = torch.zeros(batch, dtype=torch.long, device=kv.device)
        self._length_whole = self.length_t
        #: ``arange(max_len)``: row offsets of a round pass's writes
        self.rows = torch.arange(self.max_len, device=kv.device)
        #: True between :meth:`freeze` and :meth:`thaw`: passes are round passes
        self.static = False
        #: eager round passes: attend over the rows the host mirror says can be visible (``length + T``), not
        #: the whole cache (a traced round, whose shapes may not change, sets this False)
        self.key_bound = True
        #: a traced round on the reference attention: a ``[0, length + 2]`` tensor whose last size (marked
        #: dynamic) carries the host mirror's bound into the compiled graph, so one graph attends over ``length +
        #: T`` rows at every length instead of the whole cache (:meth:`bind_key_extent`); None: no such bound
        self.key_extent: Optional[torch.Tensor] = None
        #: during a round pass: the rows ``length_t[:, None] + arange(T)`` [b, T] every layer of the pass writes,
        #: made once by the pass (:meth:`write_rows`' ``dest``); None between passes
        self.pass_dest: Optional[torch.Tensor] = None

    @property
    def kv(self) -> torch.Tensor:
        """The one sequence's storage ``[L, 2, Hkv, max_len, D]`` (``batch == 1``)."""
        if self.batch != 1:
            raise ValueError(f"{type(self).__name__} holds a batch of {self.batch} sequences: use kv_batched "
                             f"[b, L, 2, Hkv, S, D], or row(r) for one sequence")
        return self.kv_batched[0]

    @property
    def length(self) -> int:
        """The longest committed length (one sequence: its length)."""
        return max(self.lengths)

    @length.setter
    def length(self, value: int) -> None:
        if self.batch != 1:
            raise ValueError(f"{type(self).__name__} holds a batch of {self.batch} sequences: set lengths per row")
        self.lengths = [int(value)]

    def row(self, r: int) -> "KVBuffer":
        """A one-sequence buffer over row ``r``'s storage, with lengths of its own (a batch's prefill runs row
        by row through these; :meth:`take_lengths` then gathers them). The same class, shallow-copied."""
        if not 0 <= r < self.batch:
            raise IndexError(f"row {r} of a batch of {self.batch}")
        view = copy.copy(self)
        view.kv_batched = self.kv_batched[r : r + 1]
        view.batch = 1
        view.lengths = [self.lengths[r]]
        view.length_t = self.length_t[r : r + 1].clone()
        view.static = False
        return view

    def take_lengths(self, rows) -> None:
        """Adopt the committed lengths of one-sequence views ``rows`` (:meth:`row`, in order), host and device."""
        if len(rows) != self.batch:
            raise ValueError(f"{self.batch} rows expected, got {len(rows)}")
        self.lengths = [int(row.length) for row in rows]
        self.length_t.copy_(torch.cat([row.length_t for row in rows]))

    def narrow(self, n: int) -> None:
        """Hold the first ``n`` sequences only (an eager round of the rows still generating runs over these):
        ``kv_batched``, ``length_t`` and the host mirrors become the first ``n`` rows of the whole buffers."""
        whole = self._kv_whole.shape[0]
        if not 1 <= n <= whole:
            raise ValueError(f"narrow({n}) of a buffer of {whole} sequences")
        self.kv_batched = self._kv_whole[:n]
        self.length_t = self._length_whole[:n]
        self.lengths = (self.lengths + [0] * whole)[:n]
        self.batch = n

    def widen(self) -> None:
        """Hold every sequence of the whole buffers again (their lengths zero: the next generation prefills)."""
        self.lengths = [0] * self._kv_whole.shape[0]
        self.narrow(self._kv_whole.shape[0])

    def move_row(self, src: int, dst: int) -> None:
        """Copy sequence ``src``'s committed rows, its lengths (host and device) into row ``dst`` (whose contents
        are no longer needed): the committed rows only, ``[0, length)``, the rest is scratch."""
        used = self.lengths[src]
        if used:
            self.kv_batched[dst, :, :, :, :used].copy_(self.kv_batched[src, :, :, :, :used])
        self.length_t[dst : dst + 1].copy_(self.length_t[src : src + 1])
        self.lengths[dst] = self.lengths[src]

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
        keys, values = layer[0], layer[1]
        if self.geometry is not None:  # this slot's corners of the padded storage
            h, dk, dv = self.geometry[layer_idx]
            keys, values = keys[:h, :, :dk], values[:h, :, :dv]
        keys[:, self.length : end].copy_(k)
        values[:, self.length : end].copy_(v)
        return keys[:, :end], values[:, :end]

    def commit(self, n: int) -> None:
        """Keep the first ``n`` rows written after ``length`` (both lengths move)."""
        self._check_room(n)
        self.length = self.length + int(n)
        self.length_t.fill_(self.length)

    def crop(self, length: int) -> None:
        """Forget everything from position ``length`` on (one sequence)."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot crop a cache of length {self.length} to {length}")
        self.length = int(length)
        self.length_t.fill_(self.length)

    # ------------------------------------------------- round passes
    def key_rows(self, new: int) -> int:
        """Rows a round pass writing ``new`` rows past the committed ones attends over: the whole cache
        (``max_len``, fixed: traced rounds), or with :attr:`key_bound` the ``length + new`` the host mirrors
        bound them by (the longest row's; keys past a row's are masked either way, so both give the same
        attention)."""
        if self.key_extent is not None:  # a symbolic size under tracing: ``max(length, 1) + 2`` at this call
            return min(self.max_len, self.key_extent.shape[1] - 2 + int(new))
        return min(self.max_len, self.length + int(new)) if self.key_bound else self.max_len

    def bind_key_extent(self) -> None:
        """Carry the host mirror's longest length into :attr:`key_extent` (made and marked dynamic on first use)
        before a traced pass: its size is ``max(length, 1) + 2``. Never 0 or 1, and no key count of 1 either
        (an empty cache's one-row pass, the warm-up's): the tracer specializes sizes 0 and 1. Attending over
        one masked row more than an empty cache holds changes nothing."""
        extent = max(self.length, 1) + 2
        if self.key_extent is None:
            import torch._dynamo

            self.key_extent = torch.empty(0, extent)
            torch._dynamo.mark_dynamic(self.key_extent, 1)
        else:
            self.key_extent.resize_(0, extent)

    def write_rows(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor, start: torch.Tensor, keys: int,
                   dest: Optional[torch.Tensor] = None):
        """Write ``k, v [b, Hkv, T, D]`` of each sequence ``r`` at rows ``start[r] + arange(T)`` (``start [b]`` on
        the device; a sequence's rows are distinct, so the scatter has no overlap); return the layer's first
        ``keys`` rows of every sequence ``(k, v) [b, Hkv, keys, D]`` (:meth:`key_rows`). ``dest``: those rows
        ``[b, T]`` when the caller made them once for every layer of its pass (then ``start`` is unused)."""
        T = k.shape[-2]
        if self.geometry is not None:  # rows padded to the storage's (Hkv, D): zeros where the slot has none
            k, v = self._padded(k), self._padded(v)
        if dest is None:
            dest = start[:, None] + self.rows[:T]
        if self.batch == 1:  # the one-sequence form of the op (the layout is the same)
            dflash_kernels.kv_write_(self.kv_batched[0], layer_idx, dest[0], k[0], v[0])
        else:
            dflash_kernels.kv_write_(self.kv_batched, layer_idx, dest, k, v)
        layer = self.kv_batched[:, layer_idx]
        if self.geometry is not None:
            h, dk, dv = self.geometry[layer_idx]
            return layer[:, 0, :h, :keys, :dk], layer[:, 1, :h, :keys, :dv]
        return layer[:, 0, :, :keys], layer[:, 1, :, :keys]

    def _padded(self, x: torch.Tensor) -> torch.Tensor:
        """A pass's rows ``[b, h, T, d]`` of a smaller slot, zero-padded to the storage's ``[b, Hkv, T, D]`` (only
        the ``T`` new rows are copied; the cache is written in place by the one op as for one geometry)."""
        heads, dim = self.kv_batched.shape[3], self.kv_batched.shape[-1]
        return torch.nn.functional.pad(x, (0, dim - x.shape[-1], 0, 0, 0, heads - x.shape[1]))

    def freeze(self) -> None:
        """From now on passes are round passes (``length_t`` holds the committed lengths: one sequence's from its
        host mirror; a batch's were taken from its rows by :meth:`take_lengths`)."""
        if self.batch == 1:
            self.length_t.fill_(self.length)
        self.static = True

    def mirror(self, lengths) -> None:
        """Refresh the host mirrors from values the round's one read brought back (no device access): an int (one
        sequence) or one per sequence."""
        if isinstance(lengths, int):
            lengths = [lengths]
        if len(lengths) != self.batch:
            raise ValueError(f"{self.batch} lengths expected, got {len(lengths)}")
        self.lengths = [int(n) for n in lengths]

    def thaw(self) -> None:
        """Back to empty caches for the next prefill (the buffers are kept: captured graphs hold them)."""
        self.static = False
        self.lengths = [0] * self.batch
        self.length_t.zero_()
