"""KV-cache compaction after a DDTree walk, one Triton launch for all layers.

The verify pass leaves ``[prefix | root, node 1, ..., node N]`` in the cache;
only the accepted path survives. :func:`compact_kv_` moves the accepted rows
``src_positions[i]`` to ``dst_start + i`` (``i < n``) in every layer, key and
value, head::

    kv[l, c, h, dst_start + i, :] = kv_before[l, c, h, src_positions[i], :]     i < n

where ``n`` is ``A = len(src_positions)``, or ``min(num_rows, A)`` when the
row count is a device tensor (the DDTree loop passes a fixed ``A = max path
length`` buffer and keeps the real count on the device: no host sync).

Kernel layout: a program owns one ``(layer, k/v, head, head-dim tile)`` slice
and walks the rows in chunks of ``BLOCK_A = 16`` rows, in order. Within a
chunk it loads all 16 source rows, then executes a CTA barrier
(``tl.debug_barrier()``, PTX ``bar.sync 0``), then stores the 16 rows.

Why that is race free
---------------------
Write ``d(i) = dst_start + i`` and ``s(i) = src_positions[i]``. The caller
guarantees (and ``check=True`` verifies) ``s`` strictly increasing and
``s(i) >= d(i)``. Within one slice, every memory conflict is a pair (load of
row ``i`` at ``s(i)``, store of row ``j`` at ``d(j)``) with ``s(i) == d(j)``;
two stores never collide (``d`` is injective), loads never conflict with loads.

1. *An earlier row's source equals a later row's destination* (``i < j``,
   ``s(i) == d(j)``; e.g. accepted nodes ``[0, 2, 3]``: ``s = [L, L+2, L+3]``,
   ``d = [L, L+1, L+2]``, row 1 reads ``L+2`` which row 2 writes). This is a
   write-after-read hazard: the load of row ``i`` must be performed before
   the store of row ``j``.

   * Same chunk: the rows live in different threads/warps, so program order
     alone orders nothing. The barrier does: every thread's chunk loads come
     before it in program order, every chunk store after it, and ``bar.sync``
     guarantees that memory accesses requested before it by the participating
     threads are performed relative to all of them (PTX ISA, ``bar.sync``
     memory ordering). LLVM/ptxas cannot move a global access across it.
   * ``i`` in an earlier chunk than ``j`` (cross chunk): the load of ``i``
     precedes barrier ``c(i)`` in its thread; the thread of ``j`` passes
     barrier ``c(i)`` before it even reaches chunk ``c(j) > c(i)``, so the
     store of ``j`` is again performed after the load.
   * Same row (``i == j``, ``s(i) == d(i)``): the stored value is the loaded
     register (a data dependence), and it is the same value anyway.

2. *A later row's source lies beyond every earlier destination* (the pairs
   with ``i > j``): ``s(i) >= d(i) > d(j)``, so no store of an earlier row
   ever touches a later row's source. There is no read-after-write
   dependence at all and no ordering is needed. In particular the loads of
   chunk ``c + 1`` may overtake (or see, or not see) the stores of chunk
   ``c`` made by other warps: the addresses are disjoint. Every load
   therefore reads the value from before the kernel started, which is what
   the reference (``index_select`` then ``copy_``) computes.

Cross program: different programs own different ``(layer, k/v, head)``
slices or different head-dim columns, so their address sets are disjoint
given a cache whose layout does not overlap itself: the launcher refuses
any ``kv`` where two indices could address one element (stride-0
broadcasts, ``as_strided`` aliasing), from its sizes and strides
(:func:`dflash_kernels.reference.kv_compaction.check_kv_layout`), so no
inter-program ordering is needed. Memory visibility to later
work: the stores are ordinary global stores; the next kernel on the stream
sees them (kernel boundary). No thread ever needs to *read* another thread's
store within this kernel (case 2), so no fence beyond the barrier is needed.
The loop bound ``n`` is uniform across the CTA (a scalar, or one loaded
value), so every thread reaches every barrier (no divergent ``bar.sync``).
The launch uses ``num_stages=1`` (no software pipelining: no asynchronous
copies of a later chunk in flight across the barrier; hoisting a later
chunk's plain loads would be harmless anyway, by case 2).

Device-side destination (``dst_start`` an int tensor ``[1]``; the op
``torch.ops.dflash.compact_kv_.tensor``, for a compiled / CUDA-graph step):
the kernel loads ``d0 = dst_start[0]`` (and the count) at its start, before
its first store, and every destination address is ``d0 + i``: the value is
fixed for the whole launch, so the argument above holds with ``d(i) = d0 + i``
unchanged. ``dst_start``, ``num_rows`` and ``src_positions`` are int tensors
the kernel only reads; the launcher refuses a ``dst_start`` / ``num_rows``
that shares storage with ``kv`` (metadata only), so no store of the launch
can change them while other programs still read them.

A batch of sequences
--------------------
``kv [b, L, 2, Hkv, Smax, D]`` (row ``r``'s slice ``kv[r]`` is one
sequence's cache), ``src_positions [b, A]``, ``dst_start [b]`` and
``num_rows [b]`` (int tensors on ``kv.device``): every row is compacted as
the device-destination form compacts one sequence, in ONE launch
(``_compact_kv_batched_kernel``)::

    kv[r, l, c, h, dst_start[r] + i, :] = kv_before[r, l, c, h, src_positions[r, i], :]     i < n(r)

with ``n(r) = clamp(num_rows[r], 0, A)`` (``A`` without ``num_rows``); a
row with ``n(r) = 0`` (a finished sequence) moves nothing. A program owns one
``(row, layer, k/v, head, head-dim tile)`` slice and runs the same chunk loop
(``_move_rows``) over that row's sources, with ``d(i) = dst_start[r] + i``
and ``s(i) = src_positions[r, i]``: the preconditions hold per row, so the
in-row argument above holds for each row unchanged. Slices of different
rows ``r`` are disjoint memory: ``kv[r]`` and ``kv[r']`` are different index
ranges of the first dim, and the launcher refuses (sizes and strides, all
six dims) a ``kv`` where two indices could address one element, so no store
of row ``r`` can touch an element row ``r'`` reads or writes, and programs of
different rows need no ordering. ``n(r)`` and ``dst_start[r]`` are loaded at
the program's start, before its first store, so they are uniform across the
CTA (every thread reaches every barrier); the launcher refuses
``dst_start`` / ``num_rows`` / ``src_positions`` sharing storage with ``kv``.
The binary does not depend on ``b`` (only the grid does).

Triton's CPU interpreter runs a program as whole-block numpy (all loads of a
chunk before all stores), so it cannot show the race the barrier prevents;
the GPU compile test checks the barrier's position in the PTX instead.

Recompiles: ``BLOCK_A`` is always 16 (rows beyond 16 walk several chunks);
``BLOCK_D`` depends on the head dim only; the row count and ``dst_start`` are
``do_not_specialize``. One binary per (model, dtype, count-on-device or not);
the batched kernel adds one per (model, dtype), whatever ``b`` and ``A``.
"""

from __future__ import annotations

from typing import List, Optional

import torch
import triton
import triton.language as tl
from torch import Tensor

from . import _C  # noqa: F401  (registers the C++ op dflash::kv_write_, csrc/kv_write.cpp)
from . import reference as _reference
from ._declare import declare, dispatch
from .reference.kv_compaction import check_kv_layout

__all__ = ["compact_kv_", "kv_write_"]

#: Rows per chunk: fixed, so that the path length never picks a new binary.
BLOCK_A = 16

#: Launch configurations :func:`compact_kv_` can choose (row chunk x head-dim tile).
KV_COMPACTION_CONFIGS: List[dict] = [
    {"BLOCK_A": BLOCK_A, "BLOCK_D": block_d, "num_warps": 4, "num_stages": 1}
    for block_d in (16, 32, 64, 128)
]


#: Integer kernel arguments that vary per round: never specialized (no recompiles).
DO_NOT_SPECIALIZE = ("n_rows", "dst_start")
#: The device count and destination may be slices at any offset of a state buffer: no alignment specialization.
UNALIGNED_PTRS = ("count_ptr", "dst_ptr")
#: The batched kernel's per-round integer: the row count ``A`` (also each row's stride in the sources).
BATCHED_DO_NOT_SPECIALIZE = ("n_rows",)
#: Its per-row counts and destinations, ``[b]`` slices of state buffers: no alignment specialization.
BATCHED_UNALIGNED_PTRS = ("count_ptr", "dst_ptr")

#: ``(L, Hkv, Smax, D)`` of real target caches: Qwen3-8B (36 layers, 8 kv
#: heads, head dim 128) and Llama-3.2-1B (16 layers, 8 kv heads, head dim 64).
REAL_CACHE_SHAPES = ((36, 8, 8192, 128), (16, 8, 8192, 64))

_TRITON_TYPE = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.int64: "i64",
                torch.int32: "i32"}


def kv_compaction_config(n_rows: int, head_dim: int) -> dict:
    """Launch config: ``BLOCK_A = 16`` rows per chunk whatever ``n_rows``; head-dim tile 16..128."""
    block_d = min(128, max(16, triton.next_power_of_2(head_dim)))
    return {"BLOCK_A": BLOCK_A, "BLOCK_D": block_d, "num_warps": 4, "num_stages": 1}


@triton.jit
def _move_rows(base, src_row_ptr, n, dst0, offs_d, d_ok, stride_pos, stride_dim, BLOCK_A: tl.constexpr):
    """One slice's rows ``i < n``: ``base[dst0 + i] = base_before[src_row_ptr[i]]`` (positions scaled by
    ``stride_pos``, head-dim columns ``offs_d``), chunk by chunk of ``BLOCK_A`` rows, in order.

    Per chunk: load every source row, CTA barrier, store every destination row (see the module
    docstring for why that is race free). ``n`` and ``dst0`` must be uniform across the CTA."""
    for first in range(0, n, BLOCK_A):
        rows = first + tl.arange(0, BLOCK_A)
        row_ok = rows < n
        src = tl.load(src_row_ptr + rows, mask=row_ok, other=0).to(tl.int64)
        ok = row_ok[:, None] & d_ok[None, :]
        chunk = tl.load(base + src[:, None] * stride_pos + offs_d[None, :] * stride_dim, mask=ok)
        # Every load of this chunk (all warps) is performed before any store of
        # this chunk or a later one: an earlier row's source may be a later
        # row's destination.
        tl.debug_barrier()
        dst = dst0 + rows.to(tl.int64)
        tl.store(base + dst[:, None] * stride_pos + offs_d[None, :] * stride_dim, chunk, mask=ok)


@triton.jit(do_not_specialize=DO_NOT_SPECIALIZE, do_not_specialize_on_alignment=UNALIGNED_PTRS)
def _compact_kv_kernel(
    kv_ptr,  # [L, 2, Hkv, Smax, D]
    src_ptr,  # int64 / int32 [A] source positions
    count_ptr,  # int64 / int32 [1] device row count (read only with HAS_COUNT)
    dst_ptr,  # int64 / int32 [1] device first destination row (read only with DST_IN_MEMORY)
    n_rows,  # A
    dst_start,  # the first destination row (0 and unused with DST_IN_MEMORY)
    n_heads, head_dim,
    stride_layer, stride_kv, stride_head, stride_pos, stride_dim,
    HAS_COUNT: tl.constexpr, BLOCK_A: tl.constexpr, BLOCK_D: tl.constexpr, DST_IN_MEMORY: tl.constexpr = False,
):
    """Program (slice = (layer, k/v, head), head-dim tile): rows in order, chunk by chunk.

    Per chunk of BLOCK_A rows: load every source row, CTA barrier, store every
    destination row (see the module docstring for why that is race free).
    ``DST_IN_MEMORY``: the first destination row is ``dst_ptr[0]``, loaded
    before the first store (every store address depends on it).
    """
    slice_id = tl.program_id(0)
    head = slice_id % n_heads
    kv_index = (slice_id // n_heads) % 2
    layer = slice_id // (2 * n_heads)
    base = (kv_ptr + layer.to(tl.int64) * stride_layer + kv_index.to(tl.int64) * stride_kv
            + head.to(tl.int64) * stride_head)
    offs_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    d_ok = offs_d < head_dim
    if HAS_COUNT:
        n = tl.minimum(tl.maximum(tl.load(count_ptr).to(tl.int64), 0), n_rows).to(tl.int32)
    else:
        n = n_rows
    if DST_IN_MEMORY:
        dst0 = tl.load(dst_ptr).to(tl.int64)
    else:
        dst0 = dst_start.to(tl.int64)
    _move_rows(base, src_ptr, n, dst0, offs_d, d_ok, stride_pos, stride_dim, BLOCK_A)


@triton.jit(do_not_specialize=BATCHED_DO_NOT_SPECIALIZE, do_not_specialize_on_alignment=BATCHED_UNALIGNED_PTRS)
def _compact_kv_batched_kernel(
    kv_ptr,  # [b, L, 2, Hkv, Smax, D]
    src_ptr,  # int64 / int32 [b, A] source positions, contiguous (row r at src_ptr + r * A)
    count_ptr,  # int64 / int32 [b] per-row counts (read only with HAS_COUNT)
    dst_ptr,  # int64 / int32 [b] per-row first destination rows
    n_rows,  # A
    n_layers, n_heads, head_dim,
    stride_batch, stride_layer, stride_kv, stride_head, stride_pos, stride_dim,
    stride_count, stride_dst,
    HAS_COUNT: tl.constexpr, BLOCK_A: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Program (slice = (row, layer, k/v, head), head-dim tile): that row's moved rows in order.

    ``n(r) = clamp(count_ptr[r], 0, A)`` (``A`` without ``HAS_COUNT``) and ``dst_ptr[r]`` are loaded
    before the first store; then the single form's chunk loop (:func:`_move_rows`). Rows ``r`` are
    disjoint slices of ``kv`` (see the module docstring)."""
    slice_id = tl.program_id(0)
    head = slice_id % n_heads
    kv_index = (slice_id // n_heads) % 2
    layer = (slice_id // (2 * n_heads)) % n_layers
    batch = (slice_id // (2 * n_heads * n_layers)).to(tl.int64)
    base = (kv_ptr + batch * stride_batch + layer.to(tl.int64) * stride_layer + kv_index.to(tl.int64) * stride_kv
            + head.to(tl.int64) * stride_head)
    offs_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    d_ok = offs_d < head_dim
    if HAS_COUNT:
        n = tl.minimum(tl.maximum(tl.load(count_ptr + batch * stride_count).to(tl.int64), 0), n_rows).to(tl.int32)
    else:
        n = n_rows
    dst0 = tl.load(dst_ptr + batch * stride_dst).to(tl.int64)
    _move_rows(base, src_ptr + batch * n_rows, n, dst0, offs_d, d_ok, stride_pos, stride_dim, BLOCK_A)


def launch_configs(shapes=REAL_CACHE_SHAPES, dtypes=(torch.bfloat16, torch.float16, torch.float32),
                   src_dtypes=(torch.int64, torch.int32)) -> List[dict]:
    """Every distinct binary :func:`compact_kv_` launches for these cache shapes (for the GPU compile test).

    Each entry: ``name``, ``kernel``, ``signature``, ``constexprs``,
    ``num_warps``, ``num_stages``, ``divisible_by_16``, ``do_not_specialize``
    (what ``tests/gpu_compile.compile_for_gpu`` takes). The integer arguments
    are specialized as the Triton runtime does at a contiguous cache of that
    shape (``stride_dim == 1`` becomes a constexpr; head dim and the other
    strides are multiples of 16); the row count and ``dst_start`` are
    ``do_not_specialize``. Both count modes (host ``A``, device ``num_rows``)
    and both destination modes (host int, device ``dst_start``: only with a
    device count, the static op's form).
    """
    from .gather import runtime_int_specialization

    out, seen = [], set()
    for n_layers, n_heads, smax, head_dim in shapes:
        cfg = kv_compaction_config(16, head_dim)
        ints = {"n_rows": 16, "dst_start": 4000, "n_heads": n_heads, "head_dim": head_dim,
                "stride_layer": 2 * n_heads * smax * head_dim, "stride_kv": n_heads * smax * head_dim,
                "stride_head": smax * head_dim, "stride_pos": head_dim, "stride_dim": 1}
        types, divisible, ones = runtime_int_specialization(ints, DO_NOT_SPECIALIZE)
        for dtype in dtypes:
            for src_dtype in src_dtypes:
                for has_count, dst_mem in ((False, False), (True, False), (True, True)):
                    count_type = "*i64" if has_count else "*" + _TRITON_TYPE[src_dtype]
                    dst_type = "*i64" if dst_mem else "*" + _TRITON_TYPE[src_dtype]
                    signature = dict({"kv_ptr": "*" + _TRITON_TYPE[dtype], "src_ptr": "*" + _TRITON_TYPE[src_dtype],
                                      "count_ptr": count_type, "dst_ptr": dst_type}, **types)
                    constexprs = dict({"HAS_COUNT": has_count, "BLOCK_A": cfg["BLOCK_A"],
                                       "BLOCK_D": cfg["BLOCK_D"], "DST_IN_MEMORY": dst_mem}, **ones)
                    key = (tuple(sorted(signature.items())), tuple(sorted(constexprs.items())), tuple(divisible))
                    if key in seen:
                        continue
                    seen.add(key)
                    out.append(dict(
                        name=(f"compact_kv[{_TRITON_TYPE[dtype]} src={_TRITON_TYPE[src_dtype]} count={has_count} "
                              f"dst_in_memory={dst_mem} "
                              f"A{cfg['BLOCK_A']}xD{cfg['BLOCK_D']} div16={','.join(divisible) or 'none'}]"),
                        kernel=_compact_kv_kernel, signature=signature, constexprs=constexprs,
                        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], divisible_by_16=divisible,
                        do_not_specialize=list(DO_NOT_SPECIALIZE), head_dim=head_dim))
    return out


def batched_launch_configs(shapes=REAL_CACHE_SHAPES, dtypes=(torch.bfloat16, torch.float16, torch.float32),
                           src_dtypes=(torch.int64, torch.int32), batch: int = 4) -> List[dict]:
    """Every distinct binary the batched form of :func:`compact_kv_` launches for caches
    ``[batch, *shape]`` (entries as :func:`launch_configs`'s).

    The integers are specialized as the runtime does at a contiguous ``[b, L, 2, Hkv, Smax, D]``
    cache with contiguous ``[b]`` counts and destinations (``stride_dim``, ``stride_count`` and
    ``stride_dst`` equal 1 become constexprs; head dim and the cache strides are multiples of 16);
    the row count ``A`` is ``do_not_specialize``. ``b`` only sizes the grid (no argument depends on it),
    so the binaries are those of every ``b``. Both count modes (``num_rows [b]`` or None).
    """
    from .gather import runtime_int_specialization

    out, seen = [], set()
    for n_layers, n_heads, smax, head_dim in shapes:
        cfg = kv_compaction_config(16, head_dim)
        row = n_layers * 2 * n_heads * smax * head_dim
        ints = {"n_rows": 16, "n_layers": n_layers, "n_heads": n_heads, "head_dim": head_dim,
                "stride_batch": row, "stride_layer": 2 * n_heads * smax * head_dim,
                "stride_kv": n_heads * smax * head_dim, "stride_head": smax * head_dim, "stride_pos": head_dim,
                "stride_dim": 1, "stride_count": 1, "stride_dst": 1}
        types, divisible, ones = runtime_int_specialization(ints, BATCHED_DO_NOT_SPECIALIZE)
        for dtype in dtypes:
            for src_dtype in src_dtypes:
                for has_count in (True, False):
                    signature = dict({"kv_ptr": "*" + _TRITON_TYPE[dtype], "src_ptr": "*" + _TRITON_TYPE[src_dtype],
                                      "count_ptr": "*i64", "dst_ptr": "*i64"}, **types)
                    constexprs = dict({"HAS_COUNT": has_count, "BLOCK_A": cfg["BLOCK_A"],
                                       "BLOCK_D": cfg["BLOCK_D"]}, **ones)
                    key = (tuple(sorted(signature.items())), tuple(sorted(constexprs.items())), tuple(divisible))
                    if key in seen:
                        continue
                    seen.add(key)
                    out.append(dict(
                        name=(f"compact_kv_batched[b={batch} {_TRITON_TYPE[dtype]} src={_TRITON_TYPE[src_dtype]} "
                              f"count={has_count} A{cfg['BLOCK_A']}xD{cfg['BLOCK_D']} "
                              f"div16={','.join(divisible) or 'none'}]"),
                        kernel=_compact_kv_batched_kernel, signature=signature, constexprs=constexprs,
                        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], divisible_by_16=divisible,
                        do_not_specialize=list(BATCHED_DO_NOT_SPECIALIZE), head_dim=head_dim, batch=batch))
    return out


_KV_SHAPES = "[L, 2, Hkv, Smax, D] (one sequence) or [b, L, 2, Hkv, Smax, D] (a batch)"


def _shares_storage(t, kv) -> bool:
    """Whether the int tensor ``t`` lives in ``kv``'s storage (metadata only; no value is read)."""
    return (isinstance(t, torch.Tensor) and kv.numel() > 0 and kv.device.type != "meta"
            and t.untyped_storage().data_ptr() == kv.untyped_storage().data_ptr())


def _check_batched_metadata(kv, src_positions, dst_start, num_rows) -> None:
    """:func:`_check_metadata` of the batched form (``kv [b, L, 2, Hkv, Smax, D]``): no value is read."""
    b = kv.shape[0]
    if kv.shape[2] != 2:
        raise ValueError(f"compact_kv_: kv must be {_KV_SHAPES}, got shape {tuple(kv.shape)}")
    check_kv_layout(kv, "compact_kv_")  # sizes and strides only, all six dims: rows never share an element
    if src_positions.dim() != 2 or src_positions.shape[0] != b:
        raise ValueError(f"compact_kv_: with a batched kv (b = {b}), src_positions must be [b, A] = [{b}, A] "
                         f"(each row's source positions), got shape {tuple(src_positions.shape)}")
    if src_positions.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"compact_kv_: src_positions must be int64 or int32, got {src_positions.dtype}")
    if src_positions.device != kv.device:
        raise ValueError(f"compact_kv_: with a batched kv, src_positions must be on kv's device {kv.device} "
                         f"(absolute rows), got {src_positions.device}")
    if not isinstance(dst_start, torch.Tensor):
        raise ValueError(f"compact_kv_: a batched kv [b, L, 2, Hkv, Smax, D] takes dst_start as an int64/int32 "
                         f"tensor [b] = [{b}] on kv's device (each row's first destination), got {dst_start!r}")
    if num_rows is not None and not isinstance(num_rows, torch.Tensor):
        raise TypeError(f"compact_kv_: num_rows must be None or an int64 tensor [b] = [{b}] on kv's device, "
                        f"got {type(num_rows).__name__}")
    for name, t in (("dst_start", dst_start), ("num_rows", num_rows)):
        if t is None:
            continue
        if tuple(t.shape) != (b,):
            raise ValueError(f"compact_kv_: with a batched kv (b = {b}), {name} must have shape [b] = [{b}] "
                             f"(one value per row), got {tuple(t.shape)}")
        if t.dtype not in (torch.int64, torch.int32):
            raise ValueError(f"compact_kv_: {name} must be int64 or int32, got {t.dtype}")
        if t.device != kv.device:
            raise ValueError(f"compact_kv_: {name} must be on kv's device {kv.device}, got {t.device}")
    for name, t in (("dst_start", dst_start), ("num_rows", num_rows), ("src_positions", src_positions)):
        if _shares_storage(t, kv):
            raise ValueError(f"compact_kv_: {name} must not share storage with kv (the kernel writes kv)")


def _check_metadata(kv, src_positions, dst_start, num_rows) -> None:
    """Checks that read no tensor values (no host sync): types, shapes, dtypes, devices."""
    if not isinstance(kv, torch.Tensor) or not isinstance(src_positions, torch.Tensor):
        raise TypeError("compact_kv_: kv and src_positions must be torch.Tensor")
    if kv.dim() == 6:
        return _check_batched_metadata(kv, src_positions, dst_start, num_rows)
    if kv.dim() != 5 or kv.shape[1] != 2:
        raise ValueError(f"compact_kv_: kv must be {_KV_SHAPES}, got shape {tuple(kv.shape)}")
    check_kv_layout(kv, "compact_kv_")  # sizes and strides only
    if src_positions.dim() != 1:
        raise ValueError(f"compact_kv_: src_positions must be 1-D [A], got shape {tuple(src_positions.shape)}")
    if src_positions.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"compact_kv_: src_positions must be int64 or int32, got {src_positions.dtype}")
    if isinstance(dst_start, torch.Tensor):
        if dst_start.dtype not in (torch.int64, torch.int32):
            raise ValueError(f"compact_kv_: a tensor dst_start must be int64 (or int32), got {dst_start.dtype}")
        if dst_start.numel() != 1 or dst_start.dim() > 1:
            raise ValueError(f"compact_kv_: a tensor dst_start must have shape [1] or [], got {tuple(dst_start.shape)}")
        if dst_start.device != kv.device:
            raise ValueError(f"compact_kv_: a tensor dst_start must be on kv's device {kv.device}, "
                             f"got {dst_start.device}")
        if src_positions.device != kv.device:
            raise ValueError(f"compact_kv_: with a tensor dst_start, src_positions must be on kv's device "
                             f"{kv.device} (absolute rows), got {src_positions.device}")
    elif not isinstance(dst_start, int) or isinstance(dst_start, bool) or dst_start < 0:
        raise ValueError(f"compact_kv_: dst_start must be an int >= 0 or an int64 tensor [1], got {dst_start!r}")
    for name, t in (("dst_start", dst_start), ("num_rows", num_rows)):
        if _shares_storage(t, kv):
            raise ValueError(f"compact_kv_: {name} must not share storage with kv (the kernel writes kv)")
    if src_positions.device.type != "cpu" and src_positions.device != kv.device:
        raise ValueError(
            f"compact_kv_: src_positions must be on the CPU or on kv's device {kv.device}, got {src_positions.device}"
        )
    if num_rows is not None:
        if not isinstance(num_rows, torch.Tensor):
            raise TypeError(f"compact_kv_: num_rows must be None or an int64 tensor [1] on kv's device, "
                            f"got {type(num_rows).__name__}")
        if num_rows.numel() != 1 or num_rows.dim() > 1:
            raise ValueError(f"compact_kv_: num_rows must have shape [1] or [], got {tuple(num_rows.shape)}")
        if num_rows.dtype not in (torch.int64, torch.int32):
            raise ValueError(f"compact_kv_: num_rows must be int64 or int32, got {num_rows.dtype}")
        if num_rows.device != kv.device:
            raise ValueError(f"compact_kv_: num_rows must be on kv's device {kv.device}, got {num_rows.device}")


def _check_row_values(src, dst_start: int, num_rows, smax: int, row: str = "", at: str = "",
                      a_is: str = "len(src_positions)") -> None:
    """The debug checks of one sequence's moved rows, on host values: ``src [A]`` int64 (CPU),
    ``dst_start`` an int, ``num_rows`` None or an int. ``row`` prefixes the messages (``"row 2: "``),
    ``at`` the position indices (``"2, "``: ``src_positions[2, i]``)."""
    a = src.numel()
    if dst_start < 0:
        raise ValueError(f"compact_kv_: {row}dst_start = {dst_start} must be >= 0")
    if num_rows is not None:
        n = int(num_rows)
        if not 0 <= n <= a:
            raise ValueError(f"compact_kv_: {row}num_rows = {n} must be in [0, A] = [0, {a}] "
                             f"(A = {a_is})")
        src = src[:n]
        a = n
    if a == 0:
        return
    if a > 1:
        steps = src[1:] - src[:-1]
        if bool((steps <= 0).any()):
            i = int((steps <= 0).nonzero()[0, 0])
            raise ValueError(
                f"compact_kv_: {row}src_positions must be strictly increasing, got {int(src[i])} then "
                f"{int(src[i + 1])} at {at}{i}"
            )
    below = src < dst_start + torch.arange(a)
    if bool(below.any()):
        i = int(below.nonzero()[0, 0])
        raise ValueError(
            f"compact_kv_: {row}src_positions[{at}{i}] = {int(src[i])} must be >= dst_start + {i} = {dst_start + i} "
            "(rows only move towards the prefix)"
        )
    if int(src[-1]) >= smax:
        raise ValueError(f"compact_kv_: {row}src_positions[{at}{a - 1}] = {int(src[-1])} is beyond the cache "
                         f"length Smax = {smax}")


def _check_values(kv, src_positions, dst_start, num_rows) -> None:
    """The debug checks over the moved rows (may sync: they read the positions on the host)."""
    # Host copy: A small ints (a sync when they live on a GPU; pass CPU positions to avoid it).
    src = src_positions.detach().to("cpu", torch.int64)
    if kv.dim() == 6:  # every row of the batch, with its own destination and count
        dst = dst_start.detach().to("cpu", torch.int64)
        counts = None if num_rows is None else num_rows.detach().to("cpu", torch.int64)
        for r in range(kv.shape[0]):
            _check_row_values(src[r], int(dst[r]), None if counts is None else int(counts[r]), kv.shape[4],
                              row=f"row {r}: ", at=f"{r}, ", a_is="src_positions.shape[1]")
        return
    if isinstance(dst_start, torch.Tensor):
        dst_start = int(dst_start.reshape(()).item())
    _check_row_values(src, dst_start, None if num_rows is None else int(num_rows.reshape(()).item()), kv.shape[3])


def _launch_batched(kv: torch.Tensor, src_positions: torch.Tensor, dst_start: torch.Tensor,
                    num_rows: Optional[torch.Tensor]) -> torch.Tensor:
    """One launch for every row of ``kv [b, L, 2, Hkv, Smax, D]`` (metadata already checked)."""
    b, n_layers, _, n_heads, _, head_dim = kv.shape
    a = src_positions.shape[1]
    if a == 0 or kv.numel() == 0:
        return kv
    src_dev = src_positions.contiguous()  # row r at r * A (a device copy only if it was strided)
    count = num_rows if num_rows is not None else dst_start  # never read without HAS_COUNT
    cfg = kv_compaction_config(a, head_dim)
    grid = (b * n_layers * 2 * n_heads, triton.cdiv(head_dim, cfg["BLOCK_D"]))
    _compact_kv_batched_kernel[grid](
        kv, src_dev, count, dst_start, a, n_layers, n_heads, head_dim, *kv.stride(),
        count.stride(0), dst_start.stride(0),
        HAS_COUNT=num_rows is not None, BLOCK_A=cfg["BLOCK_A"], BLOCK_D=cfg["BLOCK_D"],
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    return kv


def _launch(kv: torch.Tensor, src_positions: torch.Tensor, dst_start,
            num_rows: Optional[torch.Tensor]) -> torch.Tensor:
    if kv.dim() == 6:
        return _launch_batched(kv, src_positions, dst_start, num_rows)
    n_layers, _, n_heads, _, head_dim = kv.shape
    a = src_positions.numel()
    if a == 0 or kv.numel() == 0:
        return kv
    # CPU positions: one host->device copy (no sync); device ones are used as they are.
    src_dev = src_positions.to(kv.device, non_blocking=True).contiguous()
    count = num_rows.reshape(1) if num_rows is not None else src_dev  # never read without HAS_COUNT
    dst_mem = isinstance(dst_start, torch.Tensor)
    dst_ptr, dst_arg = (dst_start.reshape(1), 0) if dst_mem else (src_dev, dst_start)  # never read if not dst_mem
    cfg = kv_compaction_config(a, head_dim)
    grid = (n_layers * 2 * n_heads, triton.cdiv(head_dim, cfg["BLOCK_D"]))
    _compact_kv_kernel[grid](
        kv, src_dev, count, dst_ptr, a, dst_arg, n_heads, head_dim,
        kv.stride(0), kv.stride(1), kv.stride(2), kv.stride(3), kv.stride(4),
        HAS_COUNT=num_rows is not None, BLOCK_A=cfg["BLOCK_A"], BLOCK_D=cfg["BLOCK_D"], DST_IN_MEMORY=dst_mem,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    return kv


def compact_kv_triton(kv: torch.Tensor, src_positions: torch.Tensor, dst_start: int, *,
                      num_rows: Optional[torch.Tensor] = None, check: bool = True) -> torch.Tensor:
    """Triton launcher of :func:`compact_kv_` (validates, then one launch; either form: one sequence, or a
    batch ``kv [b, L, 2, Hkv, Smax, D]`` with per-row tensors)."""
    _check_metadata(kv, src_positions, dst_start, num_rows)
    if check:
        _check_values(kv, src_positions, dst_start, num_rows)
    return _launch(kv, src_positions, dst_start, num_rows)


def compact_kv_(kv: torch.Tensor, src_positions: torch.Tensor, dst_start, *,
                num_rows: Optional[torch.Tensor] = None, check: bool = True,
                backend: Optional[str] = None) -> torch.Tensor:
    """In place, every layer/key-value/head: ``kv[..., dst_start + i, :] = kv[..., src_positions[i], :]``, ``i < n``.

    A batch of ``b`` independent sequences (``kv`` 6-D ``[b, L, 2, Hkv, Smax, D]``, row ``r``'s
    slice ``kv[r]`` one sequence's cache) takes one value per row: ``src_positions [b, A]``,
    ``dst_start [b]`` and ``num_rows [b]`` (or None: ``A`` rows each), int64/int32 tensors on
    ``kv.device``, and moves every row's rows in ONE launch::

        kv[r, ..., dst_start[r] + i, :] = kv_before[r, ..., src_positions[r, i], :]     i < n(r)

    with ``n(r) = clamp(num_rows[r], 0, A)``: a row with ``num_rows[r] <= 0`` (a finished sequence)
    moves nothing. The contract below holds per row (with ``check=True`` it is verified row by row,
    and ``num_rows[r]`` must lie in ``[0, A]``).
    ``b = 1`` gives exactly the one-sequence result of the device-destination form on ``kv[0]``.

    Args:
        kv: ``[L, 2, Hkv, Smax, D]`` cache, any dtype, any strides whose
            layout does not overlap itself (a contiguous buffer or a slice,
            step or permutation of one; stride-0 broadcasts and aliasing
            ``as_strided`` views raise a ValueError).
        src_positions: ``[A]`` int64/int32 on the CPU or on ``kv.device``;
            over the moved rows: strictly increasing, ``src_positions[i] >=
            dst_start + i``, ``< Smax``. Entries ``i >= n`` are never read.
        dst_start: first destination position (typically the position of
            the first row to keep after the committed prefix): an int, or an
            int64/int32 tensor ``[1]`` / ``[]`` on ``kv.device`` read in-kernel
            (then ``src_positions`` must be on ``kv.device`` too): a compiled /
            CUDA-graph step, whose launch depends on ``A`` and the cache shape
            only (pass ``check=False`` there: the check reads values on the host).
        num_rows: optional int64/int32 tensor ``[1]`` or ``[]`` on
            ``kv.device``: only rows ``i < n = min(num_rows, A)`` move (the
            count stays on the device; values below 0 move nothing). None:
            ``n = A``.
        check: True validates the positions over the moved rows (reads them
            and ``num_rows`` on the host: a sync for device tensors; the debug
            path). False trusts the input: only shapes, dtypes and devices are
            checked, no tensor value is read on the host (no sync).
        backend: 'triton' or 'reference' to fix the backend (a compiled round
            does), None: :func:`dflash_kernels.get_backend`.

    Under ``torch.compile`` the call is the custom op ``dflash::compact_kv_`` on
    both backends: traced index math on the cache would be functionalized into
    a copy of the whole cache.

    Returns:
        ``kv``, compacted. Positions past ``dst_start + n`` keep stale values.
    """

    def traced():  # (the op validates when it runs: the layout check reads storage pointers)
        if isinstance(dst_start, torch.Tensor):
            torch.ops.dflash.compact_kv_.tensor(kv, src_positions, dst_start, num_rows)
        else:
            torch.ops.dflash.compact_kv_.default(kv, src_positions, dst_start, num_rows, check)
        return kv

    def prepare():
        _check_metadata(kv, src_positions, dst_start, num_rows)
        if check:
            _check_values(kv, src_positions, dst_start, num_rows)

    return dispatch(backend, kv.device, opaque=True, prepare=prepare, traced=traced,
                    triton=lambda: _launch(kv, src_positions, dst_start, num_rows),
                    reference=lambda: _reference.compact_kv_(kv, src_positions, dst_start, num_rows=num_rows))


@declare("compact_kv_", mutates={"kv"}, fake=lambda a: None)
def _compact_kv_op(kv: Tensor, src_positions: Tensor, dst_start: int, num_rows: Optional[Tensor] = None,
                   check: bool = True) -> None:
    """:func:`compact_kv_`: moves the accepted rows of ``kv`` in place (returns nothing)."""
    compact_kv_(kv, src_positions, dst_start, num_rows=num_rows, check=check)


@declare("compact_kv_.tensor", mutates={"kv"}, fake=lambda a: None)
def _compact_kv_tensor_op(kv: Tensor, src_positions: Tensor, dst_start: Tensor,
                          num_rows: Optional[Tensor] = None) -> None:
    """:func:`compact_kv_` with ``dst_start`` (int64 ``[1]``), ``num_rows`` and the absolute ``src_positions``
    device tensors, read in-kernel, unchecked (no host read); moves the rows in place (returns nothing). Also
    the batched form: ``kv [b, L, 2, Hkv, Smax, D]``, ``src_positions [b, A]``, ``dst_start [b]``, ``num_rows
    [b]`` (or None), one launch for every row."""
    compact_kv_(kv, src_positions, dst_start, num_rows=num_rows, check=False)


def kv_write_(kv: torch.Tensor, layer: int, rows: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
    """Write ``key/value [Hkv, T, D]`` into rows ``rows [T]`` (device int64, distinct) of layer ``layer`` of
    ``kv [L, 2, Hkv, S, D]``, in place: ``kv[layer, 0, :, rows] = key``, ``kv[layer, 1, :, rows] = value``
    (the C++ op ``torch.ops.dflash.kv_write_``, csrc/kv_write.cpp; the same on every backend).

    A batch of ``b`` sequences: ``kv [b, L, 2, Hkv, S, D]``, ``rows [b, T]`` (distinct within each row,
    ``< S``), ``key/value [b, Hkv, T, D]``::

        kv[r, layer, 0, :, rows[r, t]] = key[r, :, t]        kv[r, layer, 1, :, rows[r, t]] = value[r, :, t]

    Either form converts to ``kv``'s dtype, reads no value of ``rows`` on the host and is one indexed
    write per key and per value (no loop over the batch).

    An op (not the ``index_copy_`` it runs) because a traced in-place write
    through a view of the cache is functionalized into a copy of the WHOLE
    cache per layer; an op with a mutable argument is re-inplaced by inductor:
    the graph writes the ``T`` rows and nothing else.
    """
    torch.ops.dflash.kv_write_(kv, layer, rows, key, value)


@torch.library.register_fake("dflash::kv_write_")
def _kv_write_fake(kv, layer, rows, key, value) -> None:
    """:func:`kv_write_` (the C++ op of csrc/kv_write.cpp) writes ``kv`` in place, returns nothing (either form:
    ``kv [L, 2, Hkv, S, D]`` or a batch ``[b, L, 2, Hkv, S, D]``)."""
    return None
