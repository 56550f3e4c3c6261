"""Pure-torch reference of the KV-cache compaction after a DDTree walk (SPEC 7.4).

After verification the target's cache holds the prefix followed by every tree
node's K/V; only the accepted path is kept. Its rows are moved, for all layers
at once, to sit contiguously right after the prefix.
"""

from __future__ import annotations

import torch

__all__ = ["compact_kv_"]


def compact_kv_(kv: torch.Tensor, src_positions: torch.Tensor, dst_start: int) -> torch.Tensor:
    """In place: ``kv[:, :, :, dst_start + i] = kv[:, :, :, src_positions[i]]`` for every ``i``.

    Args:
        kv: ``[L, 2, Hkv, Smax, D]`` cache (layers, key/value, heads, positions, head dim).
        src_positions: ``[A]`` int, strictly increasing, ``src_positions[i] >= dst_start + i``.
        dst_start: first destination position.

    Returns:
        ``kv``. ``index_select`` copies the source rows out first, so the
        overlap of source and destination ranges does not matter here.
    """
    src = src_positions.to(device=kv.device, dtype=torch.int64)
    a = src.numel()
    for layer in range(kv.shape[0]):
        rows = kv[layer].index_select(2, src)
        kv[layer, :, :, dst_start : dst_start + a].copy_(rows)
    return kv
