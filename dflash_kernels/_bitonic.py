"""Bitonic top-R of integer keys inside one Triton program (building blocks of kernels, not ops).

A tensor of ``2**n`` integer keys is viewed as the hypercube ``[2] * n`` (row-major: axis ``n - 1 - j`` is
bit ``j`` of a key's flat position). One *compare-and-swap stage* on bit ``j`` pairs each key with the key
whose position differs only in that bit, and leaves the pair's min at the lower position and its max at
the upper one (ascending), or the other way round (descending). A key's partner is ``tl.sum`` over that
size-2 axis minus the key (exact with wrapping integers): one add or lane shuffle compiled, a numpy
reduction under Triton's interpreter. (``tl.sort`` / ``tl.topk`` fetch the partner with an ``xor_sum``,
which the interpreter runs one element at a time: seconds per call where this takes milliseconds.)

* :func:`top_desc` -- the R largest keys of each row of ``x [M, T]``, sorted descending: the bitonic top-k
  of Shanbhag et al. (sort runs of R alternately up and down, then halve with an elementwise max of
  neighbouring runs and re-sort, until R keys are left).
* :func:`merge_top` -- a running ascending ``[M, R]`` and a new descending ``[M, R]`` into the R largest
  of both, ascending: ``max(run[i], best[i])`` is a bitonic sequence holding exactly the R largest of the
  union (the two are the halves of the bitonic ``run ++ best``), and one bitonic merge sorts it.

Stages per row: ``log R (log R + 1) / 2`` on T keys, ``log R + 1`` on each halving, ``log R + 1`` for the
merge. Keys are integers (the heads use distinct int64 keys, so ties have no freedom).
"""
from __future__ import annotations

import triton
import triton.language as tl

@triton.constexpr_function
def _log2(n):
    """log2 of a power of two (a shape); anything else is a compile-time error."""
    n = int(n)
    if n < 1 or n & (n - 1):
        raise ValueError(f"bitonic stages need power-of-two sizes, got {n}")
    return n.bit_length() - 1


@triton.jit
def _position_bit(n_dims: tl.constexpr, j: tl.constexpr):
    """Bit ``j`` of each key's position (0 / 1), shaped to broadcast over the hypercube ``[2] * n_dims``."""
    return tl.reshape(tl.arange(0, 2), [1] * (n_dims - j - 1) + [2] + [1] * j)


@triton.jit
def _compare_swap(h, desc, j: tl.constexpr):
    """One stage on integer hypercube ``h`` along position bit ``j``: the upper key of each pair gets the max
    where ``desc`` is 0 and the min where it is 1 (``desc``: 0, 1 or a 0 / 1 tensor broadcasting over h).

    Each key's partner is the pair's sum minus the key: exact in wrapping two's-complement arithmetic
    (``(a + b) - a == b`` modulo ``2**64``), one ``tl.sum`` over the size-2 axis (a register add, or a
    shuffle across lanes, that the compiler folds back to the partner), then one compare and one select."""
    n_dims: tl.constexpr = _log2(h.numel)
    axis: tl.constexpr = n_dims - 1 - j
    partner = tl.sum(h, axis=axis, keep_dims=True) - h
    want_max = (_position_bit(n_dims, j) ^ desc) != 0
    return tl.where((h < partner) == want_max, partner, h)


@triton.jit
def _merge(h, stage: tl.constexpr, order: tl.constexpr):
    """Bitonic merge of every run of ``2**stage`` keys of hypercube ``h`` (each run bitonic): ``order`` 0
    sorts each run ascending, 1 descending, 2 alternately by run (ascending where position bit ``stage`` is
    0)."""
    if order == 2:
        desc = _position_bit(_log2(h.numel), stage)
    else:
        desc = order
    for i in tl.static_range(stage):
        h = _compare_swap(h, desc, stage - 1 - i)
    return h


@triton.jit
def top_desc(x, R: tl.constexpr):
    """The R largest keys of each row of ``x [M, T]`` (M, T, R powers of two, R <= T), descending:
    ``[M, R]``."""
    M: tl.constexpr = x.shape[0]
    log_t: tl.constexpr = _log2(x.shape[1])
    log_r: tl.constexpr = _log2(R)
    h = tl.reshape(x, [2] * _log2(x.numel))
    # sort runs of R keys, alternately up and down (the last sort, when R == T, down)
    for i in tl.static_range(1, log_r + 1):
        h = _merge(h, i, 2 if i < log_t else 1)
    # halve: an up-run and its down-neighbour's elementwise max is a bitonic run holding their R largest
    for i in tl.static_range(log_r + 1, log_t + 1):
        h = tl.max(h, axis=_log2(h.numel) - 1 - log_r)
        h = _merge(h, log_r, 2 if i < log_t else 1)
    return tl.reshape(h, [M, R])


@triton.jit
def merge_top(run, best):
    """``run [M, R]`` ascending and ``best [M, R]`` descending -> the R largest keys of both per row,
    ascending."""
    M: tl.constexpr = run.shape[0]
    R: tl.constexpr = run.shape[1]
    h = tl.reshape(tl.maximum(run, best), [2] * _log2(run.numel))
    h = _merge(h, _log2(R), 0)
    return tl.reshape(h, [M, R])
