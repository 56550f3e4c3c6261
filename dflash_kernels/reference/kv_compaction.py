"""Pure-torch reference of the KV-cache compaction after a DDTree walk (SPEC 7.4).

After verification the target's cache holds the prefix followed by every tree
node's K/V; only the accepted path is kept. Its rows are moved, for all layers
at once, to sit contiguously right after the prefix.

Device-side destination (:func:`compact_kv_static_`, or :func:`compact_kv_`
with ``dst_start`` a tensor): for a captured step the first destination row
is an int tensor ``[1]`` on the cache's device, the sources are device
absolute rows, and nothing is read on the host: pure index math over fixed
shapes (``torch.compile(fullgraph=True)`` traces it without a graph break).
"""

from __future__ import annotations

from typing import Optional

import torch

__all__ = ["compact_kv_", "compact_kv_static_"]


def compact_kv_(kv: torch.Tensor, src_positions: torch.Tensor, dst_start: int, *,
                num_rows: Optional[torch.Tensor] = None, check: bool = True) -> torch.Tensor:
    """In place: ``kv[:, :, :, dst_start + i] = kv[:, :, :, src_positions[i]]`` for every ``i < n``.

    Args:
        kv: ``[L, 2, Hkv, Smax, D]`` cache (layers, key/value, heads, positions, head dim).
        src_positions: ``[A]`` int (CPU or ``kv.device``), over the moved
            rows strictly increasing, ``src_positions[i] >= dst_start + i``.
        dst_start: first destination position (a tensor: see :func:`compact_kv_static_`).
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
    if isinstance(dst_start, torch.Tensor):
        return compact_kv_static_(kv, src_positions, dst_start, num_rows=num_rows)
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


def compact_kv_static_(kv: torch.Tensor, src_positions: torch.Tensor, dst_start: torch.Tensor, *,
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
