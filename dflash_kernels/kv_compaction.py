"""KV-cache compaction after a DDTree walk (SPEC 7.4), one Triton launch for all layers.

The verify pass leaves ``[prefix | root, node 1, ..., node N]`` in the cache;
only the accepted path survives. :func:`compact_kv_` moves the accepted rows
``src_positions[i]`` to ``dst_start + i`` in every layer, key and value, head.

Source and destination ranges overlap (``src = [p, p+2, p+3]`` into
``[p, p+1, p+2]`` writes ``p+2`` which is also row 1's source), so programs
never split the row axis: each owns one ``(layer, k/v, head, head-dim tile)``
slice and walks the rows in chunks of ``BLOCK_A``, in order, loading a whole
chunk before storing it. That is race free because sources strictly increase
and ``src[i] >= dst_start + i``: every later source lies beyond every earlier
destination, and a chunk's stores depend on its own loads.
"""

from __future__ import annotations

from typing import List

import torch
import triton
import triton.language as tl

from . import reference as _reference
from ._dispatch import get_backend

__all__ = ["compact_kv_"]

#: Launch configurations :func:`compact_kv_` can choose (row chunk x head-dim tile).
KV_COMPACTION_CONFIGS: List[dict] = [
    {"BLOCK_A": block_a, "BLOCK_D": block_d, "num_warps": 4}
    for block_a in (1, 2, 4, 8, 16)
    for block_d in (16, 32, 64, 128)
]


def kv_compaction_config(n_rows: int, head_dim: int) -> dict:
    """Rows per chunk (up to 16) and head-dim tile (up to 128) for ``n_rows`` accepted rows."""
    block_a = min(16, triton.next_power_of_2(max(n_rows, 1)))
    block_d = min(128, max(16, triton.next_power_of_2(head_dim)))
    return {"BLOCK_A": block_a, "BLOCK_D": block_d, "num_warps": 4}


@triton.jit
def _compact_kv_kernel(
    kv_ptr, src_ptr, n_rows, dst_start, n_heads, head_dim,
    stride_layer, stride_kv, stride_head, stride_pos, stride_dim,
    BLOCK_A: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Program (slice = (layer, k/v, head), head-dim tile): rows in order, chunk by chunk."""
    slice_id = tl.program_id(0)
    head = slice_id % n_heads
    kv_index = (slice_id // n_heads) % 2
    layer = slice_id // (2 * n_heads)
    base = (kv_ptr + layer.to(tl.int64) * stride_layer + kv_index.to(tl.int64) * stride_kv
            + head.to(tl.int64) * stride_head)
    offs_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    d_ok = offs_d < head_dim
    for first in range(0, n_rows, BLOCK_A):
        rows = first + tl.arange(0, BLOCK_A)
        row_ok = rows < n_rows
        src = tl.load(src_ptr + rows, mask=row_ok, other=0)
        ok = row_ok[:, None] & d_ok[None, :]
        chunk = tl.load(base + src[:, None] * stride_pos + offs_d[None, :] * stride_dim, mask=ok)
        dst = (dst_start + rows).to(tl.int64)
        tl.store(base + dst[:, None] * stride_pos + offs_d[None, :] * stride_dim, chunk, mask=ok)


def _check_compaction(kv: torch.Tensor, src_positions: torch.Tensor, dst_start: int) -> torch.Tensor:
    """Validate the arguments; returns ``src_positions`` as an int64 CPU tensor (for the value checks)."""
    if not isinstance(kv, torch.Tensor) or not isinstance(src_positions, torch.Tensor):
        raise TypeError("compact_kv_: kv and src_positions must be torch.Tensor")
    if kv.dim() != 5 or kv.shape[1] != 2:
        raise ValueError(f"compact_kv_: kv must be [L, 2, Hkv, Smax, D], got shape {tuple(kv.shape)}")
    if src_positions.dim() != 1:
        raise ValueError(f"compact_kv_: src_positions must be 1-D [A], got shape {tuple(src_positions.shape)}")
    if src_positions.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"compact_kv_: src_positions must be int64 or int32, got {src_positions.dtype}")
    if not isinstance(dst_start, int) or isinstance(dst_start, bool) or dst_start < 0:
        raise ValueError(f"compact_kv_: dst_start must be an int >= 0, got {dst_start!r}")
    if src_positions.device.type != "cpu" and src_positions.device != kv.device:
        raise ValueError(
            f"compact_kv_: src_positions must be on the CPU or on kv's device {kv.device}, got {src_positions.device}"
        )
    # Host copy: A small ints (a sync when they live on a GPU; pass CPU positions to avoid it).
    src = src_positions.detach().to("cpu", torch.int64)
    a, smax = src.numel(), kv.shape[3]
    if a == 0:
        return src
    if a > 1:
        steps = src[1:] - src[:-1]
        if bool((steps <= 0).any()):
            i = int((steps <= 0).nonzero()[0, 0])
            raise ValueError(
                f"compact_kv_: src_positions must be strictly increasing, got {int(src[i])} then {int(src[i + 1])} at {i}"
            )
    below = src < dst_start + torch.arange(a)
    if bool(below.any()):
        i = int(below.nonzero()[0, 0])
        raise ValueError(
            f"compact_kv_: src_positions[{i}] = {int(src[i])} must be >= dst_start + {i} = {dst_start + i} "
            "(rows only move towards the prefix)"
        )
    if int(src[-1]) >= smax:
        raise ValueError(f"compact_kv_: src_positions[-1] = {int(src[-1])} is beyond the cache length Smax = {smax}")
    return src


def _launch(kv: torch.Tensor, src_positions: torch.Tensor, src_host: torch.Tensor, dst_start: int) -> torch.Tensor:
    n_layers, _, n_heads, _, head_dim = kv.shape
    a = src_host.numel()
    if a == 0 or kv.numel() == 0:
        return kv
    if src_positions.device == kv.device:
        src_dev = src_positions.to(torch.int64).contiguous()
    else:
        src_dev = src_host.to(kv.device)
    cfg = kv_compaction_config(a, head_dim)
    grid = (n_layers * 2 * n_heads, triton.cdiv(head_dim, cfg["BLOCK_D"]))
    _compact_kv_kernel[grid](
        kv, src_dev, a, dst_start, n_heads, head_dim,
        kv.stride(0), kv.stride(1), kv.stride(2), kv.stride(3), kv.stride(4),
        BLOCK_A=cfg["BLOCK_A"], BLOCK_D=cfg["BLOCK_D"], num_warps=cfg["num_warps"],
    )
    return kv


def compact_kv_triton(kv: torch.Tensor, src_positions: torch.Tensor, dst_start: int) -> torch.Tensor:
    """Triton launcher of :func:`compact_kv_` (validates, then one launch)."""
    src_host = _check_compaction(kv, src_positions, dst_start)
    return _launch(kv, src_positions, src_host, dst_start)


def compact_kv_(kv: torch.Tensor, src_positions: torch.Tensor, dst_start: int) -> torch.Tensor:
    """In place, every layer/key-value/head: ``kv[..., dst_start + i, :] = kv[..., src_positions[i], :]``.

    Args:
        kv: ``[L, 2, Hkv, Smax, D]`` cache, any dtype and strides.
        src_positions: ``[A]`` int64/int32 on the CPU (preferred: the walk
            makes them there; no sync) or on ``kv.device`` (copied to the host
            once for the checks); strictly increasing, ``src_positions[i] >=
            dst_start + i``, ``< Smax``.
        dst_start: first destination position (typically the position of
            the first row to keep after the committed prefix).

    Returns:
        ``kv``, compacted. Positions past ``dst_start + A`` keep stale values.
    """
    src_host = _check_compaction(kv, src_positions, dst_start)
    if get_backend(kv.device) == "triton":
        return _launch(kv, src_positions, src_host, dst_start)
    return _reference.compact_kv_(kv, src_host, dst_start)
