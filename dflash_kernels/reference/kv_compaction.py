"""Pure-torch reference of the KV-cache compaction after a DDTree walk.

After verification the target's cache holds the prefix followed by every tree
node's K/V; only the accepted path is kept. Its rows are moved, for all layers
at once, to sit contiguously right after the prefix.

Device-side destination (:func:`compact_kv_`
with ``dst_start`` a tensor): for a captured step the first destination row
is an int tensor ``[1]`` on the cache's device, the sources are device
absolute rows, and nothing is read on the host: pure index math over fixed
shapes (``torch.compile(fullgraph=True)`` traces it without a graph break).

A batch of ``b`` independent sequences (:func:`compact_kv_` with a 6-D
``kv [b, L, 2, Hkv, Smax, D]``, ``src_positions [b, A]``, ``dst_start [b]``,
``num_rows [b]``): every row ``r`` is compacted as the device-destination
form compacts one sequence, all rows by one gather and one scatter
(:func:`_compact_batched_`), again with no host read.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

__all__ = ["compact_kv_"]


def nested_strides(shape: Sequence[int], strides: Sequence[int]) -> bool:
    """True when no two indices of a ``(shape, strides)`` layout address the same element (a sufficient test).

    Dims of size 1 are ignored (they index nothing twice) and a layout with no
    element cannot overlap. The other dims, sorted by stride, must each have a
    stride larger than the span ``sum (size_j - 1) * stride_j`` of every
    smaller-stride dim: then an offset's digits in that mixed radix are
    unique, so distinct indices give distinct offsets. A stride 0 (broadcast)
    or two dims of one stride never pass. Not necessary in general (an
    interleaving like sizes ``(3, 2)``, strides ``(2, 3)`` has distinct
    offsets but fails), but exact for the layouts caches come in: a contiguous
    tensor and any slice, step or permutation of one (slicing shrinks spans,
    steps scale a stride and shrink its size together, permuting reorders).
    Metadata only: no tensor value is read.
    """
    if any(int(n) == 0 for n in shape):
        return True
    dims = sorted((int(st), int(n)) for n, st in zip(shape, strides) if int(n) > 1)
    span = 0  # the largest offset the smaller-stride dims reach
    for stride, size in dims:
        if stride <= span:
            return False
        span += stride * (size - 1)
    return True


def check_kv_layout(kv: torch.Tensor, who: str) -> None:
    """Refuse a ``kv`` whose layout overlaps itself (from its sizes and strides: no value is read).

    The compaction writes rows it reads, and the Triton kernel's programs each
    own a disjoint ``(layer, k/v, head, head-dim tile)`` slice: an element two
    indices share would be written through one and read through the other.
    """
    shape, strides = tuple(kv.shape), tuple(kv.stride())
    if any(st == 0 and n > 1 for st, n in zip(strides, shape)):
        raise ValueError(f"{who}: kv must not be a broadcast (stride-0) view, got shape {shape}, strides {strides}")
    if not nested_strides(shape, strides):
        raise ValueError(
            f"{who}: kv's layout overlaps itself (shape {shape}, strides {strides}): distinct indices may address "
            "the same element. Pass a contiguous cache or a slice, step or permutation of one (sorted by stride, "
            "each dim's stride must exceed the span of the smaller-stride dims)"
        )


def compact_kv_(kv: torch.Tensor, src_positions: torch.Tensor, dst_start: int, *,
                num_rows: Optional[torch.Tensor] = None, check: bool = True) -> torch.Tensor:
    """In place: ``kv[:, :, :, dst_start + i] = kv[:, :, :, src_positions[i]]`` for every ``i < n``.

    Args:
        kv: ``[L, 2, Hkv, Smax, D]`` cache (layers, key/value, heads, positions, head dim), any
            layout that does not overlap itself (:func:`check_kv_layout`). A batch of caches
            ``[b, L, 2, Hkv, Smax, D]`` takes per-row tensors: see :func:`_compact_batched_`.
        src_positions: ``[A]`` int (CPU or ``kv.device``), over the moved
            rows strictly increasing, ``src_positions[i] >= dst_start + i``.
        dst_start: first destination position (an int tensor: see :func:`_compact_device_dst_`).
        num_rows: optional int tensor ``[1]`` / ``[]`` on ``kv.device``:
            ``n = clamp(num_rows, 0, A)`` rows move; None: ``n = A``. Honoured
            without reading it on the host (no sync): rows ``i >= n`` copy
            their own destination row onto itself.
        check: accepted for signature parity with :func:`dflash_kernels.compact_kv_`
            (which does the checks); unused here.

    Returns:
        ``kv``. ``index_select`` copies the source rows out first, so the
        overlap of source and destination ranges does not matter here.
    """
    if kv.dim() == 6:
        return _compact_batched_(kv, src_positions, dst_start, num_rows=num_rows)
    if isinstance(dst_start, torch.Tensor):
        return _compact_device_dst_(kv, src_positions, dst_start, num_rows=num_rows)
    check_kv_layout(kv, "compact_kv_")
    src = src_positions.to(device=kv.device, dtype=torch.int64)
    a = src.numel()
    if num_rows is not None:
        # Only destinations inside the cache can hold a moved row (d(i) <= s(i) < Smax).
        a = max(0, min(a, kv.shape[3] - dst_start))
        rows = torch.arange(a, device=kv.device)
        n = num_rows.reshape(()).to(device=kv.device, dtype=torch.int64)
        src = torch.where(rows < n, src[:a], dst_start + rows)
    for layer in range(kv.shape[0]):
        picked = kv[layer].index_select(2, src)
        kv[layer, :, :, dst_start : dst_start + a].copy_(picked)
    return kv


def _compact_device_dst_(kv: torch.Tensor, src_positions: torch.Tensor, dst_start: torch.Tensor, *,
                       num_rows: Optional[torch.Tensor] = None, check: bool = True) -> torch.Tensor:
    """:func:`compact_kv_` with ``dst_start`` an int tensor ``[1]`` / ``[]`` on ``kv.device``: no host read.

    With ``d(i) = dst_start + i``, ``s(i) = src_positions[i]`` and ``n =
    clamp(num_rows, 0, A)`` (``A`` without ``num_rows``)::

        kv[:, :, :, d(i)] = kv_before[:, :, :, s(i)]        i < n

    rows ``i >= n`` are untouched (their ``s(i)`` is never used, and their
    ``d(i)`` may lie past the cache). The contract over the moved rows is
    :func:`compact_kv_`'s (``s`` strictly increasing, ``s(i) >= d(i)``,
    ``s(i) < Smax``), not checked (a check reads values on the host).

    How: every row ``i`` gets an effective (source, destination) pair,
    ``(s(i), d(i))`` if it moves, else ``(c, c)`` with ``c = min(d(i), Smax - 1)``
    (a row copied onto itself). The sources are gathered first
    (``index_select`` copies them out of ``kv_before``), then scattered with
    ``index_copy_``. Destinations are distinct except where several rows
    clamp to ``Smax - 1``; a moved row with ``d(i) = Smax - 1`` has
    ``s(i) = Smax - 1`` (``d(i) <= s(i) < Smax``), so every writer of that row
    writes its own old value: the result does not depend on the write order.
    """
    check_kv_layout(kv, "compact_kv_")
    smax = kv.shape[3]
    src = src_positions.to(device=kv.device, dtype=torch.int64).reshape(-1)
    a = src.numel()
    if a == 0 or smax == 0:
        return kv
    rows = torch.arange(a, device=kv.device)
    dst = dst_start.reshape(()).to(device=kv.device, dtype=torch.int64) + rows
    if num_rows is None:
        move = torch.ones(a, dtype=torch.bool, device=kv.device)
    else:
        move = rows < num_rows.reshape(()).to(device=kv.device, dtype=torch.int64)
    still = dst.clamp(0, smax - 1)
    src_eff = torch.where(move, src, still)
    dst_eff = torch.where(move, dst, still)
    picked = kv.index_select(3, src_eff)
    kv.index_copy_(3, dst_eff, picked)
    return kv


def _compact_batched_(kv: torch.Tensor, src_positions: torch.Tensor, dst_start: torch.Tensor, *,
                      num_rows: Optional[torch.Tensor] = None) -> torch.Tensor:
    """:func:`compact_kv_` for ``b`` independent sequences at once: no host read, fixed shapes.

    Args:
        kv: ``[b, L, 2, Hkv, Smax, D]``; row ``r``'s slice ``kv[r]`` is one sequence's cache. Any layout
            that does not overlap itself (:func:`check_kv_layout` over all six dims).
        src_positions: ``[b, A]`` int on ``kv.device``: row ``r``'s source positions.
        dst_start: ``[b]`` int tensor on ``kv.device``: row ``r``'s first destination position.
        num_rows: ``[b]`` int tensor on ``kv.device`` or None (``A`` for every row).

    With ``d(r, i) = dst_start[r] + i``, ``s(r, i) = src_positions[r, i]`` and
    ``n(r) = clamp(num_rows[r], 0, A)``::

        kv[r, :, :, :, d(r, i)] = kv_before[r, :, :, :, s(r, i)]        i < n(r)

    Every other element keeps its value: a row with ``n(r) = 0`` (e.g. a finished sequence) moves
    nothing. The contract over the moved rows is :func:`compact_kv_`'s, per row (``s(r, .)``
    strictly increasing, ``d(r, i) <= s(r, i) < Smax``), not checked (a check reads values on the host).

    How: :func:`_compact_device_dst_`'s effective pairs, per row: ``(s(r, i), d(r, i))`` for a moved
    row, else ``(c, c)`` with ``c = min(d(r, i), Smax - 1)``. One advanced-index gather copies every
    source out of ``kv_before`` (``[b, A, L, 2, Hkv, D]``), then one advanced-index write stores them.
    Targets ``(r, c)`` repeat only where several rows of one ``r`` clamp to ``Smax - 1``, and every such
    writer writes ``kv_before[r, .., Smax - 1]`` (a moved row there has ``s = d = Smax - 1``): the result
    does not depend on the write order. Rows of different ``r`` never share a target.
    """
    if not isinstance(dst_start, torch.Tensor):
        raise ValueError(f"compact_kv_: a batched kv [b, L, 2, Hkv, Smax, D] takes dst_start as an int tensor [b] "
                         f"(each row's first destination), got {dst_start!r}")
    b, smax = kv.shape[0], kv.shape[4]
    if src_positions.dim() != 2 or src_positions.shape[0] != b:
        raise ValueError(f"compact_kv_: with a batched kv (b = {b}), src_positions must be [b, A], "
                         f"got shape {tuple(src_positions.shape)}")
    for name, t in (("dst_start", dst_start), ("num_rows", num_rows)):
        if t is not None and tuple(t.shape) != (b,):
            raise ValueError(f"compact_kv_: with a batched kv (b = {b}), {name} must be [b], "
                             f"got shape {tuple(t.shape)}")
    check_kv_layout(kv, "compact_kv_")
    a = src_positions.shape[1]
    if b == 0 or a == 0 or smax == 0:
        return kv
    src = src_positions.to(device=kv.device, dtype=torch.int64)
    rows = torch.arange(a, device=kv.device)
    dst = dst_start.to(device=kv.device, dtype=torch.int64).reshape(b, 1) + rows  # [b, A]
    if num_rows is None:
        move = torch.ones(b, a, dtype=torch.bool, device=kv.device)
    else:
        move = rows < num_rows.to(device=kv.device, dtype=torch.int64).reshape(b, 1)
    still = dst.clamp(0, smax - 1)
    src_eff = torch.where(move, src, still)
    dst_eff = torch.where(move, dst, still)
    batch = torch.arange(b, device=kv.device).reshape(b, 1)
    picked = kv[batch, :, :, :, src_eff]  # [b, A, L, 2, Hkv, D], a copy: every read before any write
    kv[batch, :, :, :, dst_eff] = picked
    return kv
