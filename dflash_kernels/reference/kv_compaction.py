"""Pure-torch reference of the KV-cache compaction after a DDTree walk (SPEC 7.4).

After verification the target's cache holds the prefix followed by every tree
node's K/V; only the accepted path is kept. Its rows are moved, for all layers
at once, to sit contiguously right after the prefix.
"""

from __future__ import annotations

from typing import Optional

import torch

__all__ = ["compact_kv_"]


def compact_kv_(kv: torch.Tensor, src_positions: torch.Tensor, dst_start: int, *,
                num_rows: Optional[torch.Tensor] = None, check: bool = True) -> torch.Tensor:
    """In place: ``kv[:, :, :, dst_start + i] = kv[:, :, :, src_positions[i]]`` for every ``i < n``.

    Args:
        kv: ``[L, 2, Hkv, Smax, D]`` cache (layers, key/value, heads, positions, head dim).
        src_positions: ``[A]`` int (CPU or ``kv.device``), over the moved
            rows strictly increasing, ``src_positions[i] >= dst_start + i``.
        dst_start: first destination position.
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
