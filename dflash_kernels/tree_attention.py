"""Verification attention over ``[committed prefix ; tree]`` keys.

The one attention of every target pass (DFlash chain verify, AR steps, DDTree
tree verify, prefill chunks after the first) and of the drafter (its block
over the cached context, all block keys visible). ``T`` query tokens (the
"tree") attend over ``S = prefix_len + T`` keys; query ``i`` and tree key
``i`` are the same token. Query ``i`` sees every prefix key and, among the
tree keys, key ``j`` iff bit ``j`` of ``bits[i]`` (the ancestor-or-self
bitmask of :func:`dflash_kernels.ancestor_bits`, or all ones), or iff
``j <= i`` when ``bits is None`` (a causal chain). A sliding ``window``
additionally hides key ``k`` when ``pos_q(i) - pos_k(k) >= window`` (see
:func:`dflash_kernels.reference.tree_visibility`, the spec in code). Scores
may be soft-capped (``c * tanh(s / c)``, Gemma 2) and each query head may add
a sink logit to its softmax denominator (gpt-oss). A call may carry a batch
of ``b`` independent sequences (rows): each row has its own queries, keys,
committed length and, optionally, its own tree and positions; row ``r`` of the
output is the single-row call on row ``r``'s slices.

* :func:`tree_attention`: FlashAttention-2 style Triton kernel with GQA
  packing. A program owns ``BLOCK_M`` rows of one kv head, the (token, query
  head of the group) pairs flattened token-major (``row = t * G + g``), so
  each K/V tile is loaded once for all ``G = Hq / Hkv`` query heads that read
  it. It walks key tiles of ``BLOCK_N`` with an online softmax in float32:
  prefix tiles (no mask but the window's; tiles older than every row's window
  are skipped; without a window the whole tiles run unmasked, the ragged last
  one apart), then tree tiles, whose visibility comes from the bitmask
  words or from ``j <= t`` (chain); tiles past the last key any row of the
  program can see (its last token, for ancestor bits and chains) are never
  visited. No dense ``[T, S]`` mask
  exists anywhere. When a modeled time says so (:func:`choose_num_splits`:
  waves x key tiles per program, plus the merge), the
  key axis is split across programs that write partial ``(output, log2-sum-
  exp)`` pairs, merged by a second small kernel (flash-decoding style).
  A batch adds its rows to the grid (axis 1 is ``batch row * Hkv + kv
  head``): one launch, and one binary whatever ``b``.
* Loads and stores never overlap, so no program can race another: the
  attention kernel only reads ``q``, ``k``, ``v``, ``bits``, ``positions``,
  ``sinks`` and the prefix tensor (the launcher's outputs are fresh
  allocations, never views of them), and each output row (unsplit) or partial
  row ``(split, batch row, kv head, row)`` (split) is written by exactly one
  program, once, at its end: programs of different batch rows write through
  their own row's output base (``out[r]``, a distinct slice of the fresh
  ``[b, Hq, T, D]`` output) and partial index (axis 1 of the workspace is
  ``b * Hkv``), so neither kv heads nor batch rows share a written element;
  inputs shared by the rows (one tree's bits, shared positions, the sinks)
  are only read. The merge kernel reads the partials the attention launch
  wrote; the two launches are ordered on one stream, so every partial is
  complete before it is read, and the merge writes each output row from one
  program (grid axis 1 again ``batch row * Hkv + kv head``).
* Device-side prefix (``prefix_len`` an int64 tensor ``[b]``, or ``[1]`` /
  ``[]`` for one row, for a compiled / CUDA-graph step; op
  ``torch.ops.dflash.tree_attention.tensor``): K/V are the whole cache views
  ``[b, Hkv, S_max, D]``, row ``r``'s pass rows are ``[p_r, p_r + T)``. The
  grid (row tiles, b x kv heads, splits) depends only on ``b``, ``T`` and
  ``S_max`` (the split count from ``S_max - T`` prefix keys); every program
  loads its row's ``p_r`` from memory first (``PREFIX_IN_MEMORY``) and
  derives its key range from it, so a split whose share of ``[0, p_r + T)``
  is empty runs no loop and writes the neutral partial ``(0, -inf)``, which
  the merge weighs 0. Overlap argument, additionally: ``p`` is read-only for
  both launches (the launcher's outputs are fresh allocations, never ``p``'s
  storage), and is loaded before any address that depends on it is formed,
  so no store of this launch can change it; K/V rows ``>= p_r + T`` of row
  ``r`` are never loaded (every key load is masked by ``key < p_r`` or
  ``node < T``, or is a whole prefix tile, below ``(p_r // BLOCK_N) *
  BLOCK_N <= p_r``), so whatever they hold (NaN, inf) cannot reach the output.
* :func:`warmup_tree_attention`: compiles every variant a generation at
  given shapes can hit, so none compiles mid-generation.
* :func:`tree_visibility` / :func:`masked_attention`: the visibility rule as a
  bool ``[T, S]`` (``[b, T, S]`` for per-row inputs) and SDPA under it, in
  torch ops (the reference path of a pass: one visibility per window, reused
  by every layer).
* :func:`tree_attention_mask`: the dense additive mask (a test and benchmark
  helper, imported from this module).

The reference of both is :mod:`dflash_kernels.reference.tree_attention`.
"""

from __future__ import annotations

import functools
import math
import numbers
from typing import Dict, List, NamedTuple, Optional, Tuple

import torch
import triton
import triton.language as tl
from torch import Tensor

from . import reference as _reference
from ._declare import declare, dispatch
from ._dispatch import DEFAULT_ARCH, device_arch, get_backend, multiprocessor_count, triton_interpreting

#: (tree_attention_mask, the dense additive mask of a tree, is a helper of the tests and benchmarks: imported from
#: this module, not part of the package namespace)
__all__ = ["tree_attention", "tree_visibility", "masked_attention", "warmup_tree_attention"]

_LOG2E = 1.4426950408889634
_MASK_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_ATTENTION_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` of host ints (``triton.cdiv`` is a constexpr function: microseconds a call on the launch
    path)."""
    return -(-a // b)


# ----------------------------------------------------------------------------
# Dense mask
# ----------------------------------------------------------------------------

#: Launch configurations :func:`tree_attention_mask` can choose (query rows x keys per program).
TREE_MASK_CONFIGS: List[dict] = [{"BLOCK_T": 16, "BLOCK_K": 128, "num_warps": 4}]


@triton.jit
def _tree_mask_kernel(
    bits_ptr, mask_ptr, n_tree, prefix_len, n_keys, stride_bits_row, stride_bits_word, stride_mask_row,
    hidden_value, BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """Tile (query rows, keys): 0 where visible, ``hidden_value`` elsewhere."""
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    keys = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    row_ok = rows < n_tree
    key_ok = keys < n_keys
    node = tl.maximum(keys - prefix_len, 0)
    in_tree = row_ok[:, None] & ((keys >= prefix_len) & key_ok)[None, :]
    words = tl.load(bits_ptr + rows[:, None].to(tl.int64) * stride_bits_row + (node // 32)[None, :] * stride_bits_word,
                    mask=in_tree, other=0)
    visible = (keys < prefix_len)[None, :] | (((words >> (node % 32)[None, :]) & 1) != 0)
    value = tl.where(visible, 0.0, hidden_value)
    tl.store(mask_ptr + rows[:, None].to(tl.int64) * stride_mask_row + keys[None, :],
             value.to(mask_ptr.dtype.element_ty), mask=row_ok[:, None] & key_ok[None, :])


def _check_bits(bits: torch.Tensor, n_tree: int, who: str, batch: Optional[int] = None) -> None:
    """``[T, >= ceil(T/32)]`` int32, or with ``batch`` also ``[batch, T, >= ceil(T/32)]`` (a tree per row)."""
    if not isinstance(bits, torch.Tensor):
        raise TypeError(f"{who}: bits must be a torch.Tensor, got {type(bits).__name__}")
    if bits.dtype != torch.int32:
        raise ValueError(f"{who}: bits must be int32 (from ancestor_bits), got {bits.dtype}")
    words = _cdiv(n_tree, 32)
    lead = () if bits.dim() == 2 else (batch,)
    if bits.dim() not in (2, 3) or (bits.dim() == 3 and batch is None) or tuple(bits.shape[:-1]) != lead + (
            n_tree,) or bits.shape[-1] < words:
        per_row = "" if batch is None else f" (one tree for every row), or [b, T, >= ceil(T/32)] = [{batch}, " \
                                           f"{n_tree}, >= {words}] (a tree per row)"
        raise ValueError(f"{who}: bits must be [T, >= ceil(T/32)] = [{n_tree}, >= {words}]{per_row}, "
                         f"got {tuple(bits.shape)}")


def _check_prefix_len(prefix_len: int, who: str) -> None:
    if not isinstance(prefix_len, int) or isinstance(prefix_len, bool) or prefix_len < 0:
        raise ValueError(f"{who}: prefix_len must be an int >= 0, got {prefix_len!r}")


def _check_prefix_tensor(prefix_len: torch.Tensor, device: torch.device, batch: int, who: str) -> None:
    """A device prefix: an int64 / int32 tensor ``[batch]`` on ``device`` (one committed length per row; for
    one row also ``[]``); its values are not read (that would be a host sync)."""
    if prefix_len.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"{who}: a tensor prefix_len must be int64 (or int32), got {prefix_len.dtype}")
    if tuple(prefix_len.shape) != (batch,) and not (batch == 1 and prefix_len.dim() == 0):
        if batch == 1:
            raise ValueError(f"{who}: a tensor prefix_len must have shape [1] or [] (one row), "
                             f"got {tuple(prefix_len.shape)}")
        raise ValueError(f"{who}: a tensor prefix_len must have shape [b] = [{batch}] (one committed length per "
                         f"row of the batch), got {tuple(prefix_len.shape)}")
    if prefix_len.device != device:
        raise ValueError(f"{who}: prefix_len is on {prefix_len.device} but query is on {device}")


def tree_attention_mask_triton(bits: torch.Tensor, prefix_len: int, dtype: torch.dtype) -> torch.Tensor:
    """Triton launcher of :func:`tree_attention_mask`."""
    n_tree = bits.shape[0]
    n_keys = prefix_len + n_tree
    mask = torch.empty(n_tree, n_keys, dtype=dtype, device=bits.device)
    if n_tree == 0:
        return mask
    cfg = TREE_MASK_CONFIGS[0]
    grid = (_cdiv(n_tree, cfg["BLOCK_T"]), _cdiv(n_keys, cfg["BLOCK_K"]))
    _tree_mask_kernel[grid](
        bits, mask, n_tree, prefix_len, n_keys, bits.stride(0), bits.stride(1), mask.stride(0),
        torch.finfo(dtype).min, BLOCK_T=cfg["BLOCK_T"], BLOCK_K=cfg["BLOCK_K"], num_warps=cfg["num_warps"],
    )
    return mask


def tree_attention_mask(bits: torch.Tensor, prefix_len: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Dense additive mask ``[T, prefix_len + T]`` of tree attention.

    Args:
        bits: ``[T, W]`` int32 ancestor bitmask, ``W >= ceil(T/32)``.
        prefix_len: committed keys before the tree keys (all visible).
        dtype: float16, bfloat16 or float32.

    Returns:
        ``[T, prefix_len + T]`` of ``dtype`` on ``bits.device``: 0 where visible,
        ``torch.finfo(dtype).min`` where hidden (finite: softmax never gives NaN).
        Add ``[None, None]`` for a ``[B, H, T, S]`` SDPA mask.
    """
    _check_prefix_len(prefix_len, "tree_attention_mask")
    if not isinstance(bits, torch.Tensor) or bits.dim() != 2:
        raise ValueError("tree_attention_mask: bits must be a 2-D [T, W] int32 tensor")
    _check_bits(bits, bits.shape[0], "tree_attention_mask")
    if dtype not in _MASK_DTYPES:
        raise ValueError(f"tree_attention_mask: dtype must be one of {_MASK_DTYPES}, got {dtype}")
    if get_backend(bits.device) == "triton":
        return tree_attention_mask_triton(bits, prefix_len, dtype)
    return _reference.tree_attention_mask(bits, prefix_len, dtype)



# ----------------------------------------------------------------------------
# Attention kernel
# ----------------------------------------------------------------------------

#: Integer arguments of :func:`_tree_attention_kernel` that change from one
#: decoding round (or pass) to the next: never specialized, so a growing
#: prefix, another tree size or another window never compiles a new binary.
#: The batch strides of bits / positions / the prefix tensor are among them
#: (0 when shared by the rows, ``T * W`` / ``T`` / 1 per row): shared or per
#: row, one binary. Those of q / k / v / out are specialized like the other
#: q / k / v / out strides (0 for one row; with ``D % 16 == 0`` multiples of
#: 16 at any ``T``; a cache batch stride past 2^31 elements is an i64
#: argument, fixed for a cache), and must stay so: without the divisibility
#: hint the row's base pointers lose their 16-byte alignment, the K/V tile
#: loads are no longer vectorized and ptxas spills (16 to 500+ bytes of stack
#: at the bf16 D = 128 tiles, sm_80 and sm_90).
TREE_ATTENTION_DYNAMIC_INTS = ["n_tree", "prefix_len", "window", "stride_bits_row", "stride_pos", "stride_bits_b",
                               "stride_pos_b", "stride_prefix_b"]
#: The same for :func:`_merge_splits_kernel`.
MERGE_DYNAMIC_INTS = ["n_tree", "num_splits"]
MERGE_UNALIGNED_PTRS = ["sinks_ptr"]
#: Pointers that may be slices at any offset of a bigger buffer (the bits of
#: a tree, the positions of this pass, one layer's row of stacked sinks): not specialized on 16-byte alignment,
#: so a new offset never compiles a new binary.
TREE_ATTENTION_UNALIGNED_PTRS = ["bits_ptr", "pos_ptr", "sinks_ptr", "prefix_ptr"]


@triton.jit
def tanh_f32(x):
    """``tanh(x)`` in float32 from ``exp`` (no ``tanh`` instruction or libdevice call).

    ``|x| < 0.25``: the odd Taylor polynomial through ``x^9`` (truncation error
    below ``0.0089 |x|^11``, i.e. under 1e-8 relative); else ``(1 - e) / (1 + e)``
    with ``e = exp(-2|x|) <= exp(-0.5)``, whose cancellation amplifies the
    error of ``e`` by at most ``e / (1 - e) < 1.6``. Overall a few float32 ulps
    (relative error under 5e-7), on the GPU and under the interpreter alike;
    odd, saturates to +-1, ``tanh(+-inf) = +-1``.
    """
    ax = tl.abs(x)
    e = tl.exp(-2.0 * ax)
    far = (1.0 - e) / (1.0 + e)
    xs = tl.minimum(ax, 0.25)  # the polynomial is only used below 0.25 (and never overflows)
    x2 = xs * xs
    near = xs * (1.0 + x2 * (-0.3333333333333333 + x2 * (0.13333333333333333 + x2 * (
        -0.05396825396825397 + x2 * 0.021869488536155203))))
    t = tl.where(ax < 0.25, near, far)
    return tl.where(x < 0.0, -t, t)


@triton.jit
def _online_softmax_step(q, k, v, visible, m_i, l_i, acc, qk_scale, softcap_scale,
                         HAS_SOFTCAP: tl.constexpr, DOT_FP32: tl.constexpr, INPUT_PRECISION: tl.constexpr,
                         MASKED: tl.constexpr = True):
    """Fold one key tile into the running (max, sum, accumulator), base 2.

    ``q [M, D]``, ``k [D, N]``, ``v [N, D]``, ``visible [M, N]``. Scores are
    ``q k * scale * log2(e)`` (``qk_scale = scale * log2(e)``), or with
    ``HAS_SOFTCAP`` ``c * tanh(q k * scale / c) * log2(e)`` (``qk_scale =
    scale / c``, ``softcap_scale = c * log2(e)``), capped before the mask;
    hidden ones are ``-inf``. A row that has seen no visible key yet keeps
    ``m = -inf``: the exponent base then falls back to 0 so that no ``-inf -
    -inf`` appears.

    Without ``MASKED`` (a tile every row sees whole; ``visible`` is not
    read) there is no ``-inf`` select per score, and every row's new max is
    a finite score, so the base needs no ``-inf`` check either. Without a
    softcap as well, the max is taken over the raw ``q k`` and scaled once
    per row, and each exponent is one FMA ``q k * qk_scale - m``: ``qk_scale
    >= 0`` (the launcher negates ``q`` for a negative scale, exactly), and
    rounding is monotone, so ``max(q k) * qk_scale`` is exactly the max of
    the rounded scaled scores: the same ``m`` as scaling every score first,
    one FMUL per row instead of one per score.
    """
    qk = tl.dot(q, k, input_precision=INPUT_PRECISION)
    if not MASKED and not HAS_SOFTCAP:
        m_new = tl.maximum(m_i, tl.max(qk, axis=1) * qk_scale)
        alpha = tl.math.exp2(m_i - m_new)
        p = tl.math.exp2(qk * qk_scale - m_new[:, None])
    else:
        qk = qk * qk_scale
        if HAS_SOFTCAP:
            qk = tanh_f32(qk) * softcap_scale
        if MASKED:
            qk = tl.where(visible, qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, axis=1))
        if MASKED:
            m_base = tl.where(m_new == float("-inf"), 0.0, m_new)
        else:
            m_base = m_new
        alpha = tl.math.exp2(m_i - m_base)
        p = tl.math.exp2(qk - m_base[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    if DOT_FP32:
        pv = tl.dot(p, v, input_precision=INPUT_PRECISION)
    else:
        pv = tl.dot(p.to(v.dtype), v, input_precision=INPUT_PRECISION)
    acc = acc * alpha[:, None] + pv
    return m_new, l_i, acc


@triton.jit(do_not_specialize=TREE_ATTENTION_DYNAMIC_INTS,
            do_not_specialize_on_alignment=TREE_ATTENTION_UNALIGNED_PTRS)
def _tree_attention_kernel(
    q_ptr, k_ptr, v_ptr, bits_ptr, pos_ptr, sinks_ptr, prefix_ptr, out_ptr, part_out_ptr, part_lse_ptr,
    stride_qb, stride_qh, stride_qt, stride_qd,
    stride_kb, stride_kh, stride_ks, stride_kd,
    stride_vb, stride_vh, stride_vs, stride_vd,
    stride_bits_b, stride_bits_row, stride_bits_word, stride_pos_b, stride_pos, stride_prefix_b,
    stride_ob, stride_oh, stride_ot, stride_od,
    n_tree, prefix_len, window, n_kv_heads, group, qk_scale, softcap_scale,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    CHAIN: tl.constexpr, WINDOW: tl.constexpr, SPLIT_KEYS: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, HAS_SINKS: tl.constexpr,
    DOT_FP32: tl.constexpr, INPUT_PRECISION: tl.constexpr, PREFIX_IN_MEMORY: tl.constexpr = False,
    UNMASKED_PREFIX: tl.constexpr = True,
):
    """Program (row tile, batch row x kv head, key split).

    Grid axis 1 is ``batch * n_kv_heads + kv_head``: every batch row (an
    independent sequence) has its own programs, which add the row's batch
    strides to the base pointers once, first (``stride_*b``: 0 for a tensor
    shared by every row, such as one tree's bits; q / k / v / out get 0 when
    there is one row; the batch size is no argument, so one binary serves
    any, see ``TREE_ATTENTION_DYNAMIC_INTS``). Within a row:
    rows ``r = t * group + g`` (``t`` the token, ``g`` the query head within
    the group, query head ``kv_head * group + g``), ``n_tree * group`` of them.
    The key axis is cut in ``BLOCK_N`` tiles ("units"): ``ceil(prefix_len /
    BLOCK_N)`` prefix units, then the tree units, aligned on node indices (so
    a unit covers whole bitmask words). This program's units run from
    ``begin`` (0, or the first prefix unit inside the window of its oldest
    row) to ``end`` (all tree units; in chain mode only those up to its last
    token); split ``s`` of ``S = num_programs(2)`` takes the ``s``-th of ``S``
    equal chunks of that range (possibly empty). With a bitmask, tree units
    after the last bitmask word any of the program's rows has a bit in are
    not visited (for ancestor bits: the units past its last token). Without ``SPLIT_KEYS`` the
    normalized output is stored; otherwise the ``(output, log2-sum-exp)``
    partials go to the workspace ``[S, b * Hkv, rows, BLOCK_D]`` / ``[S, b *
    Hkv, rows]``. The split count is a grid dim, never a constexpr.

    ``HAS_SOFTCAP``: scores are capped (see :func:`_online_softmax_step`).
    ``HAS_SINKS``: query head ``h``'s sink logit ``sinks[h]`` joins the
    softmax denominator as a key of value 0: unsplit, the running state
    starts from it (``m = sink * log2(e)``, ``l = 1``); split, the merge
    kernel adds it once, so the partials here never include it.

    ``PREFIX_IN_MEMORY``: ``prefix_len`` (the argument, then 0) is replaced
    by the batch row's ``prefix_ptr[batch * stride_prefix_b]`` before anything
    uses it: the key range, the masks and the tree keys' rows all follow the
    value in memory (a captured graph replays with new committed lengths
    without a new launch configuration).
    """
    row_tile = tl.program_id(0)
    batch_head = tl.program_id(1)
    split = tl.program_id(2)
    batch = batch_head // n_kv_heads
    kv_head = batch_head - batch * n_kv_heads
    # The batch row's offsets, once, in int64 (a cache [b, L, 2, Hkv, S_max, D] has a batch
    # stride of L * 2 * Hkv * S_max * D elements, past 2^31): folded into the base pointers, so
    # no per-element address below carries them.
    row = batch.to(tl.int64)
    if PREFIX_IN_MEMORY:
        # Read once, before any address or bound that depends on it (no store of this launch
        # can write it: it is an input, the outputs are fresh buffers).
        prefix_len = tl.load(prefix_ptr + row * stride_prefix_b).to(tl.int32)
    q_ptr += row * stride_qb
    k_ptr += row * stride_kb
    v_ptr += row * stride_vb
    out_ptr += row * stride_ob
    bits_ptr += row * stride_bits_b
    pos_ptr += row * stride_pos_b

    n_rows = n_tree * group
    rows = row_tile * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < n_rows
    tok = rows // group
    head = kv_head * group + rows % group
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    lane = tl.arange(0, BLOCK_N)

    q = tl.load(q_ptr + head[:, None].to(tl.int64) * stride_qh + tok[:, None].to(tl.int64) * stride_qt
                + offs_d[None, :] * stride_qd, mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    if DOT_FP32:
        q = q.to(tl.float32)
    k_base = k_ptr + kv_head.to(tl.int64) * stride_kh
    v_base = v_ptr + kv_head.to(tl.int64) * stride_vh
    # A K / V tile's element offsets within the kv head: the tile's first key times the key
    # stride (a scalar, once per tile) plus these, the same for every tile (loop-invariant,
    # formed once), so a tile's addresses cost one int32 add per element rather than a
    # multiply-add from its key index; this keeps the bf16 D = 128 x 32-row and D = 64 x
    # 64-row tiles under 255 registers (they spilled 8-64 B with Triton 3.9 when every
    # offset was rebuilt from the key index). The int64 base is added last, to the int32
    # sum: an int64 tile base plus these would let the compiler hoist a 64-bit copy of every
    # element's offset out of the key loops (twice their registers). int32 is in range: an
    # offset, masked lanes included (less than one tile past the last key, BLOCK_D - 1 past
    # the head dim), is below (S + BLOCK_N) * stride_s + BLOCK_D * stride_d, which the
    # launcher checks is below 2^31 (_check_kv_offsets); the batch row and kv head offsets
    # are in the int64 bases.
    k_offs = lane[None, :] * stride_ks + offs_d[:, None] * stride_kd
    v_offs = lane[:, None] * stride_vs + offs_d[None, :] * stride_vd

    if HAS_SINKS and not SPLIT_KEYS:
        # The sink as one more key with value 0: exp(sink - m) in the denominator only.
        m_i = tl.load(sinks_ptr + head, mask=row_ok, other=float("-inf")).to(tl.float32) * 1.4426950408889634
        l_i = tl.full([BLOCK_M], 1.0, dtype=tl.float32)
    else:
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    prefix_units = tl.cdiv(prefix_len, BLOCK_N)
    bits_rows = bits_ptr + tok.to(tl.int64) * stride_bits_row
    if CHAIN:
        # Tree key j is visible to token t iff j <= t: nothing past the last token.
        last_node = tl.minimum(n_tree - 1, (row_tile * BLOCK_M + BLOCK_M - 1) // group)
        end = prefix_units + tl.cdiv(last_node + 1, BLOCK_N)
        stop = end
    else:
        end = prefix_units + tl.cdiv(n_tree, BLOCK_N)
        # Stop after the last bitmask word any row of this program has a bit
        # in: for ancestor bits the word of its last token, for all-ones the
        # last word. (The splits still cut [begin, end): loop bounds that
        # depend on this scan would keep the prefix loop from pipelining.)
        last_word = tl.zeros([BLOCK_M], dtype=tl.int32) - 1
        for word_index in range(0, tl.cdiv(n_tree, 32)):
            word = tl.load(bits_rows + word_index * stride_bits_word, mask=row_ok, other=0)
            last_word = tl.where(word != 0, word_index, last_word)
        last_node = tl.minimum(n_tree - 1, tl.max(last_word, axis=0) * 32 + 31)
        stop = prefix_units + tl.cdiv(last_node + 1, BLOCK_N)
    if WINDOW:
        pos_q = tl.load(pos_ptr + tok.to(tl.int64) * stride_pos, mask=row_ok, other=0).to(tl.int32)
        # Prefix key k (position k) is inside row i's window iff k > pos_q(i) - window.
        oldest = tl.min(tl.where(row_ok, pos_q, 2147483647), axis=0)
        begin = tl.minimum(tl.maximum(oldest - window + 1, 0) // BLOCK_N, prefix_units)
    else:
        begin = 0
    if SPLIT_KEYS:
        per_split = tl.cdiv(end - begin, tl.num_programs(2))
        lo = begin + split * per_split
        hi = tl.minimum(lo + per_split, end)
    else:
        lo = begin
        hi = end

    # Prefix keys: visible to every row. Without a window, the whole tiles (every one but a ragged
    # last) run with no mask at all: unmasked loads, no -inf select on the scores. The ragged tile,
    # and with a window every tile, take the masked loop (at most one iteration without a window).
    # (UNMASKED_PREFIX off: every prefix tile takes the masked loop, one loop body fewer.)
    if WINDOW or not UNMASKED_PREFIX:
        ragged_lo = lo
    else:
        whole_units = prefix_len // BLOCK_N
        for unit in range(lo, tl.minimum(hi, whole_units)):
            first_key = unit * BLOCK_N
            if HEAD_DIM == BLOCK_D:
                k = tl.load(k_base + (first_key * stride_ks + k_offs))
                v = tl.load(v_base + (first_key * stride_vs + v_offs))
            else:
                k = tl.load(k_base + (first_key * stride_ks + k_offs), mask=d_ok[:, None], other=0.0)
                v = tl.load(v_base + (first_key * stride_vs + v_offs), mask=d_ok[None, :], other=0.0)
            if DOT_FP32:
                k = k.to(tl.float32)
                v = v.to(tl.float32)
            m_i, l_i, acc = _online_softmax_step(q, k, v, None, m_i, l_i, acc, qk_scale, softcap_scale,
                                                 HAS_SOFTCAP, DOT_FP32, INPUT_PRECISION, MASKED=False)
        ragged_lo = tl.maximum(lo, whole_units)
    for unit in range(ragged_lo, tl.minimum(hi, prefix_units)):
        first_key = unit * BLOCK_N
        offs_n = first_key + lane
        n_ok = offs_n < prefix_len
        k = tl.load(k_base + (first_key * stride_ks + k_offs), mask=n_ok[None, :] & d_ok[:, None], other=0.0)
        v = tl.load(v_base + (first_key * stride_vs + v_offs), mask=n_ok[:, None] & d_ok[None, :], other=0.0)
        if DOT_FP32:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        # (Padded rows have q = 0 and are never stored: they need no mask.)
        if WINDOW:
            visible = n_ok[None, :] & ((pos_q[:, None] - offs_n[None, :]) < window)
        else:
            visible = n_ok[None, :]
        m_i, l_i, acc = _online_softmax_step(q, k, v, visible, m_i, l_i, acc, qk_scale, softcap_scale,
                                             HAS_SOFTCAP, DOT_FP32, INPUT_PRECISION)

    # Tree keys: node j at key prefix_len + j.
    for unit in range(tl.maximum(lo, prefix_units), tl.minimum(hi, stop)):
        first_node = (unit - prefix_units) * BLOCK_N
        nodes = first_node + lane
        n_ok = nodes < n_tree
        if CHAIN:
            visible = n_ok[None, :] & (nodes[None, :] <= tok[:, None])
        else:
            # One bitmask word per row and 32 keys: a [BLOCK_M] load each,
            # expanded against the lanes it covers (no [BLOCK_M, BLOCK_N] gather).
            lane_word = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.int32)
            for w in tl.static_range(BLOCK_N // 32):
                word_index = first_node // 32 + w
                word = tl.load(bits_rows + word_index * stride_bits_word,
                               mask=row_ok & (tok * 0 + word_index * 32 < n_tree), other=0)
                lane_word = tl.where(((lane // 32) == w)[None, :], word[:, None], lane_word)
            visible = (((lane_word >> (lane % 32)[None, :]) & 1) != 0) & n_ok[None, :]
        if WINDOW:
            pos_k = tl.load(pos_ptr + nodes.to(tl.int64) * stride_pos, mask=n_ok, other=0).to(tl.int32)
            visible = visible & ((pos_q[:, None] - pos_k[None, :]) < window)
        first_key = prefix_len + first_node
        k = tl.load(k_base + (first_key * stride_ks + k_offs), mask=n_ok[None, :] & d_ok[:, None], other=0.0)
        v = tl.load(v_base + (first_key * stride_vs + v_offs), mask=n_ok[:, None] & d_ok[None, :], other=0.0)
        if DOT_FP32:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        m_i, l_i, acc = _online_softmax_step(q, k, v, visible, m_i, l_i, acc, qk_scale, softcap_scale,
                                             HAS_SOFTCAP, DOT_FP32, INPUT_PRECISION)

    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    out = acc / l_safe[:, None]
    if not SPLIT_KEYS:
        tl.store(out_ptr + head[:, None].to(tl.int64) * stride_oh + tok[:, None].to(tl.int64) * stride_ot
                 + offs_d[None, :] * stride_od,
                 out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
    else:
        part_row = (split * tl.num_programs(1) + batch_head).to(tl.int64) * n_rows + rows
        lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.math.log2(l_safe))
        tl.store(part_lse_ptr + part_row, lse, mask=row_ok)
        tl.store(part_out_ptr + part_row[:, None] * BLOCK_D + offs_d[None, :], out, mask=row_ok[:, None])


@triton.jit(do_not_specialize=MERGE_DYNAMIC_INTS, do_not_specialize_on_alignment=MERGE_UNALIGNED_PTRS)
def _merge_splits_kernel(
    part_out_ptr, part_lse_ptr, sinks_ptr, out_ptr, n_tree, n_kv_heads, group, num_splits,
    stride_ob, stride_oh, stride_ot, stride_od,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, HAS_SINKS: tl.constexpr,
):
    """Program (row tile, batch row x kv head): ``out = sum_s 2^(lse_s - M) o_s / sum_s 2^(lse_s - M)``.

    Grid, rows and workspace as in :func:`_tree_attention_kernel`; an empty
    split has ``lse = -inf`` and weighs nothing. ``HAS_SINKS``: the sink of
    the row's query head is one more term of the denominator, added here once
    (``2^(sink * log2(e) - M)``, output 0).
    """
    row_tile = tl.program_id(0)
    batch_head = tl.program_id(1)
    batch = batch_head // n_kv_heads
    kv_head = batch_head - batch * n_kv_heads
    out_ptr += batch.to(tl.int64) * stride_ob
    n_rows = n_tree * group
    rows = row_tile * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < n_rows
    offs_d = tl.arange(0, BLOCK_D)
    tok = rows // group
    head = kv_head * group + rows % group
    if HAS_SINKS:
        m_run = tl.load(sinks_ptr + head, mask=row_ok, other=float("-inf")).to(tl.float32) * 1.4426950408889634
        w_sum = tl.full([BLOCK_M], 1.0, dtype=tl.float32)
    else:
        m_run = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        w_sum = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    for split in range(0, num_splits):
        part_row = (split * tl.num_programs(1) + batch_head).to(tl.int64) * n_rows + rows
        lse = tl.load(part_lse_ptr + part_row, mask=row_ok, other=float("-inf"))
        part = tl.load(part_out_ptr + part_row[:, None] * BLOCK_D + offs_d[None, :], mask=row_ok[:, None],
                       other=0.0)
        m_new = tl.maximum(m_run, lse)
        m_base = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.math.exp2(m_run - m_base)
        weight = tl.math.exp2(lse - m_base)
        acc = acc * alpha[:, None] + part * weight[:, None]
        w_sum = w_sum * alpha + weight
        m_run = m_new
    out = acc / tl.where(w_sum == 0.0, 1.0, w_sum)[:, None]
    tl.store(out_ptr + head[:, None].to(tl.int64) * stride_oh + tok[:, None].to(tl.int64) * stride_ot
             + offs_d[None, :] * stride_od,
             out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & (offs_d < HEAD_DIM)[None, :])


# ----------------------------------------------------------------------------
# Launch configuration
# ----------------------------------------------------------------------------

#: Rows of one merge program (fixed: the merge kernel has one binary per head dim and dtype).
MERGE_BLOCK_M = 32
MERGE_NUM_WARPS = 4
#: Query-row tile sizes of the config table.
BLOCK_M_CHOICES = (16, 32, 64, 128)
#: Cost of one more row tile, in padded rows: its K/V pass over the keys
#: (the tie-break that keeps 4100 rows on 128-row tiles, 260 on 64).
TILE_COST_ROWS = 16
#: Split-KV: each split walks at least this many key tiles, at most this many splits.
MIN_TILES_PER_SPLIT = 4
MAX_SPLITS = 64
#: The split model's costs of a split launch, in key-tile times (one program folding one key tile):
#: the merge launch and the tail it adds (fixed), and each split program's fp32 partial
#: (``BLOCK_M x BLOCK_D``: written once, read once by the merge, spread over the SMs).
MERGE_FIXED_TILES = 2.0
PARTIAL_TILES = 1.0
#: ``maxnreg`` of every attention launch. Without it ptxas (13.x, as Triton
#: drives it) sometimes caps a kernel at 32-128 registers and spills to the
#: stack although 255 are available; with it no table config spills.
MAX_REGISTERS = 255


def head_dim_block(head_dim: int) -> int:
    """Padded head dim of the kernel's tiles: the next power of two, at least 16."""
    return max(16, 1 << (head_dim - 1).bit_length())


@functools.lru_cache(maxsize=None)
def _config_table(block_d: int, elem_bytes: int, hopper: bool) -> Tuple[dict, ...]:
    if elem_bytes == 4:
        # float32 (a correctness path: exact "ieee" FMA dots, no tensor cores):
        # one small tile, the only one that compiles without spills up to D = 256.
        return ({"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_D": block_d, "num_warps": 8, "num_stages": 1,
                 "maxnreg": MAX_REGISTERS, "UNMASKED_PREFIX": True},)
    configs = []
    for block_m in BLOCK_M_CHOICES:
        if block_d <= 128:
            # 128-row tiles: 64-key tiles on sm_90 (each warpgroup's 64 rows take one m64n64k16
            # wgmma chain for the scores, m64nDk16 for P V); sm_80's mma.sync registers for a
            # 128 x 64 tile pass 255 (8-56 B of spills), so 32 elsewhere (the compiled archs).
            block_n = 64 if block_m <= 64 or hopper else 32
            stages = 3
        else:  # D = 256: narrower key tiles and 2 stages keep K/V in shared memory on sm_80
            block_n, stages = 32, 2
        # About 32 fp32 accumulator elements per thread (64 at most), 4..8 warps.
        acc_per_warp = block_m * block_d // 32
        warps = min(8, max(4, acc_per_warp // 32))
        if acc_per_warp // warps > 64:
            continue
        # The unmasked loop of whole prefix tiles is one more loop body: sm_80's 128 x 32 tile at
        # D = 128 is at 255 registers without it, and spills 8 B with it (Triton 3.6).
        unmasked = hopper or block_m < 128 or block_d > 128
        configs.append({"BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_D": block_d, "num_warps": warps,
                        "num_stages": stages, "maxnreg": MAX_REGISTERS, "UNMASKED_PREFIX": unmasked})
    return tuple(configs)


def tree_attention_configs(head_dim: int, dtype: torch.dtype, arch: int = DEFAULT_ARCH) -> List[dict]:
    """Every launch configuration :func:`tree_attention` can choose for this head dim and dtype on ``arch``.

    Keys: ``BLOCK_M`` (packed rows per program), ``BLOCK_N`` (keys per tile),
    ``BLOCK_D``, ``num_warps``, ``num_stages``, ``maxnreg``, ``UNMASKED_PREFIX``
    (whole prefix tiles run unmasked: off only for sm_80's 128-row tile at
    D <= 128, which it would make spill). bf16/fp16: row
    tiles of 16/32/64/128 (no 128 at D = 256), 4 warps, 8 from 64 x 128
    accumulators up; key tiles of 64 (32 for D = 256, which also gets 2
    stages so the pipelined K/V fit in sm_80's 163 KiB, and for 128-row
    tiles off sm_90). float32: one 16 x 32 tile with exact FMA dots. The
    row tiles (``BLOCK_M``, ``num_warps``) are the same on every arch, so
    :func:`tree_attention_config` picks the same row tile everywhere. Every
    one compiles for its arch (sm_80, sm_90) without spills
    (tests/ops/test_compile_gpu_tree.py).

    The 128-row tile on sm_90 (e.g. 257 tree tokens x G = 4 = 1028 rows, D =
    128): 64-key tiles run each warpgroup's scores as 8 ``m64n64k16`` wgmma
    and P V as 4 ``m64n128k16`` per 64 keys, where 32-key tiles took 2 x 8
    ``m64n32k16`` and 2 x 2 ``m64n128k16`` with two online-softmax rescales
    (max / sum reductions, ``alpha``, ``acc *= alpha``) and two loop trips;
    228 registers (whole, bitmask), no spills, 134 KiB of shared memory.
    """
    return [dict(c) for c in _config_table(head_dim_block(head_dim), torch.finfo(dtype).bits // 8, arch // 10 == 9)]


def tree_attention_config(head_dim: int, dtype: torch.dtype, n_rows: int, arch: int = DEFAULT_ARCH) -> dict:
    """The configuration for ``n_rows = T * (Hq // Hkv)`` packed rows on ``arch``.

    A fixed function of ``(head_dim, dtype, n_rows, arch)`` (never of the prefix):
    the ``BLOCK_M`` minimizing ``padded rows + TILE_COST_ROWS * tiles``, ties
    to fewer padded rows, then to bigger tiles. E.g. 260 rows (T = 65, G = 4)
    -> 64 (320 padded), 1028 (T = 257) -> 128 (1152), 64 -> 64, 8 -> 16,
    4100 -> 128 (bf16/fp16; float32 has the one 16-row tile).
    """
    return dict(_chosen_config(head_dim_block(head_dim), torch.finfo(dtype).bits // 8, max(1, n_rows), arch // 10 == 9))


@functools.lru_cache(maxsize=None)
def _chosen_config(block_d: int, elem_bytes: int, n_rows: int, hopper: bool) -> dict:
    """:func:`tree_attention_config`'s choice, once per key (a launch reads it; callers get copies)."""

    def cost(cfg):
        tiles = -(-n_rows // cfg["BLOCK_M"])
        padded = tiles * cfg["BLOCK_M"]
        return (padded + TILE_COST_ROWS * tiles, padded, -cfg["BLOCK_M"])

    return min(_config_table(block_d, elem_bytes, hopper), key=cost)


def _auto_num_splits(device: torch.device, programs: int, key_tiles: int) -> int:
    """The launcher's split count for a grid of ``programs`` (row tiles x batch rows x kv heads): the modeled-time
    :func:`choose_num_splits` on a GPU, 1 elsewhere (the interpreter runs programs one by one)."""
    if device.type != "cuda":
        return 1
    return choose_num_splits(programs, key_tiles, multiprocessor_count(device))


def split_time(programs: int, key_tiles: int, sms: int, splits: int) -> float:
    """Modeled time of a launch of ``programs x splits`` programs, in key-tile times.

    One program per SM at a time (a 128-row tile takes most of an SM's
    registers and shared memory; smaller tiles may share an SM, which the
    model does not count), every split walking ``ceil(key_tiles /
    splits)`` tiles (the kernel's equal chunks), so the launch runs
    ``ceil(programs * splits / sms)`` waves of that many tiles; a split launch
    adds the merge: ``MERGE_FIXED_TILES`` plus ``PARTIAL_TILES`` per split
    program and SM (its partial written and read back).
    """
    waves = -(-programs * splits // sms)
    time = waves * -(-key_tiles // splits)
    if splits > 1:
        time += MERGE_FIXED_TILES + PARTIAL_TILES * programs * splits / sms
    return time


def choose_num_splits(programs: int, key_tiles: int, sms: int) -> int:
    """Key splits for a grid of ``programs`` (row tiles x batch rows x kv heads) on ``sms`` SMs.

    The ``s`` in ``1 .. min(MAX_SPLITS, key_tiles // MIN_TILES_PER_SPLIT)``
    of least :func:`split_time` (ties to fewer splits). A wave-efficiency
    threshold only counts how full the last wave is; this counts what a
    program walks. 257 tree rows at G = 4 (1028 packed rows, 9 tiles of 128,
    8 kv heads: 72 programs) on 132 SMs, 64-key tiles:

    * 4096-key prefix (69 key tiles): ``s = 1`` 69 (72 of 132 SMs busy),
      ``s = 3`` 2 waves x 23 + 3.6 = 49.6, ``s = 5`` 3 x 14 + 4.7 = 46.7,
      ``s = 7`` 4 x 10 + 5.8 = 45.8 (chosen); ideal 72 x 69 / 132 = 37.6.
    * 32768-key prefix (517 tiles): ``s = 5`` 3 x 104 + 4.7 = 316.7, ``s = 7``
      4 x 74 + 5.8 = 301.8, ``s = 11`` 6 whole waves x 47 + 8 = 290
      (chosen); ideal 282.
    """
    most = max(1, min(MAX_SPLITS, key_tiles // MIN_TILES_PER_SPLIT))
    return min(range(1, most + 1), key=lambda s: (split_time(programs, key_tiles, sms, s), s))


# ----------------------------------------------------------------------------
# Launcher
# ----------------------------------------------------------------------------

def _input_precision(dtype: torch.dtype) -> str:
    """``tl.dot`` precision: exact for float32; bf16/fp16 dots are exact on tensor cores anyway."""
    return "ieee" if dtype == torch.float32 else "tf32"


_placeholders: Dict[Tuple[torch.device, torch.dtype], torch.Tensor] = {}


def _placeholder(device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """A one-element tensor passed for a pointer the kernel variant never reads."""
    key = (device, dtype)
    if key not in _placeholders:
        _placeholders[key] = torch.zeros(1, dtype=dtype, device=device)
    return _placeholders[key]


def _batch_view(x: torch.Tensor, name: str, layout: str) -> Tuple[torch.Tensor, Optional[int]]:
    """``x`` as a 4-D view and its batch size (None when it came without a batch dim)."""
    if x.dim() == 4:
        return x, x.shape[0]
    if x.dim() == 3:
        return x[None], None
    raise ValueError(f"tree_attention: {name} must be {layout} or [b, {layout[1:]}, got {tuple(x.shape)}")


def _check_softcap(softcap, who: str) -> Optional[float]:
    """``softcap`` as a float (None stays None); a finite real ``> 0`` or a ValueError naming it."""
    if softcap is None:
        return None
    if isinstance(softcap, bool) or not isinstance(softcap, numbers.Real) or not math.isfinite(softcap) \
            or softcap <= 0:
        raise ValueError(f"{who}: softcap must be None or a finite float > 0, got {softcap!r}")
    return float(softcap)


def _check_sinks(sinks, n_heads: int, device: torch.device, who: str) -> None:
    if sinks is None:
        return
    if not isinstance(sinks, torch.Tensor):
        raise TypeError(f"{who}: sinks must be a torch.Tensor [Hq] or None, got {type(sinks).__name__}")
    if not sinks.dtype.is_floating_point or sinks.dim() != 1 or sinks.shape[0] != n_heads:
        raise ValueError(
            f"{who}: sinks must be a 1-D float tensor [Hq] = [{n_heads}] (one logit per query head), "
            f"got {tuple(sinks.shape)} {sinks.dtype}"
        )
    if sinks.device != device:
        raise ValueError(f"{who}: sinks is on {sinks.device} but query is on {device}")


class _Inputs(NamedTuple):
    """:func:`tree_attention`'s arguments checked and in the launcher's layout: one batch dim everywhere."""

    q: torch.Tensor  # [b, Hq, T, D]
    k: torch.Tensor  # [b, Hkv, S, D]
    v: torch.Tensor
    bits: Optional[torch.Tensor]  # None (chain), or [b, T, W] (a shared tree expanded: batch stride 0)
    positions: Optional[torch.Tensor]  # None, or [b, T] (shared ones expanded)
    prefix_len: object  # an int, or an int tensor [b] (a view of the caller's)
    batched: bool  # the query had a batch dim (the output gets it too)


def _check_attention_inputs(query, key, value, bits, prefix_len, positions, window, softcap=None,
                            sinks=None) -> _Inputs:
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"tree_attention: {name} must be a torch.Tensor, got {type(t).__name__}")
    if bits is not None and not isinstance(bits, torch.Tensor):
        raise TypeError(
            f"tree_attention: bits must be a torch.Tensor or None (causal chain), got {type(bits).__name__}"
        )
    if not isinstance(prefix_len, torch.Tensor):
        _check_prefix_len(prefix_len, "tree_attention")
    q, q_batch = _batch_view(query, "query", "[Hq, T, D]")
    k, k_batch = _batch_view(key, "key", "[Hkv, S, D]")
    v, v_batch = _batch_view(value, "value", "[Hkv, S, D]")
    b = 1 if q_batch is None else q_batch
    for name, other in (("key", k_batch), ("value", v_batch)):
        if other is None and b != 1:
            raise ValueError(
                f"tree_attention: {name} without a batch dim ([Hkv, S, D]) needs a query of batch size 1, "
                f"got query {tuple(query.shape)}: pass key/value as [b, Hkv, S, D], one row per sequence"
            )
        if other is not None and other != b:
            raise ValueError(
                f"tree_attention: {name} has batch size {other} but query has {b}: query [b, Hq, T, D] and "
                f"key/value [b, Hkv, S, D] need the same b (one row per sequence)"
            )
    _, hq, n_tree, d = q.shape
    _, hkv, s, dk = k.shape
    if v.shape != k.shape:
        raise ValueError(f"tree_attention: value shape {tuple(value.shape)} must equal key shape {tuple(key.shape)}")
    if dk != d:
        raise ValueError(f"tree_attention: query head dim {d} != key head dim {dk}")
    if not 1 <= d <= 256:
        raise ValueError(f"tree_attention: head dim must be in 1..256, got {d}")
    if hkv == 0 or hq % hkv != 0:
        raise ValueError(f"tree_attention: query heads ({hq}) must be a multiple of kv heads ({hkv})")
    if isinstance(prefix_len, torch.Tensor):
        _check_prefix_tensor(prefix_len, query.device, b, "tree_attention")
        if s < n_tree:
            raise ValueError(
                f"tree_attention: with a tensor prefix_len, key/value are the whole cache views and need "
                f"S_max >= T rows, got S_max = {s} < T = {n_tree}"
            )
        prefix_len = prefix_len.reshape(b)
    elif s != prefix_len + n_tree:
        raise ValueError(
            f"tree_attention: key/value length {s} must be prefix_len + T = {prefix_len} + {n_tree}; "
            "slice the cache view to the live positions (or pass prefix_len as a device tensor with the "
            "whole cache views)"
        )
    if not (query.dtype == key.dtype == value.dtype) or query.dtype not in _ATTENTION_DTYPES:
        raise ValueError(
            f"tree_attention: query/key/value must share one dtype among {_ATTENTION_DTYPES}, "
            f"got {query.dtype}/{key.dtype}/{value.dtype}"
        )
    tensors = [query, key, value] + [t for t in (bits, positions) if isinstance(t, torch.Tensor)]
    devices = {t.device for t in tensors}
    if len(devices) != 1:
        raise ValueError(f"tree_attention: all tensors must be on one device, got {sorted(map(str, devices))}")
    if bits is not None:
        _check_bits(bits, n_tree, "tree_attention", batch=b)
        bits = bits.expand(b, *bits.shape[-2:]) if bits.dim() == 3 else bits[None].expand(b, *bits.shape)
    if window is not None and (not isinstance(window, int) or isinstance(window, bool) or window < 1):
        raise ValueError(f"tree_attention: window must be None or an int >= 1, got {window!r}")
    if positions is not None:
        if not isinstance(positions, torch.Tensor):
            raise TypeError(f"tree_attention: positions must be a torch.Tensor or None, got {type(positions).__name__}")
        if positions.dtype not in (torch.int32, torch.int64) or not (
                (positions.dim() == 1 and positions.shape[0] == n_tree)
                or (positions.dim() == 2 and tuple(positions.shape) == (b, n_tree))):
            raise ValueError(
                f"tree_attention: positions must be a 1-D [T] = [{n_tree}] int32/int64 tensor (shared by every "
                f"row) or a 2-D [b, T] = [{b}, {n_tree}] one (a row each), got {tuple(positions.shape)} "
                f"{positions.dtype}"
            )
        positions = positions.expand(b, n_tree) if positions.dim() == 2 else positions[None].expand(b, n_tree)
    _check_softcap(softcap, "tree_attention")
    _check_sinks(sinks, hq, query.device, "tree_attention")
    return _Inputs(q, k, v, bits, positions, prefix_len, q_batch is not None)


def tree_attention_triton(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    bits: Optional[torch.Tensor],
    prefix_len: int,
    scale: Optional[float] = None,
    *,
    positions: Optional[torch.Tensor] = None,
    window: Optional[int] = None,
    softcap: Optional[float] = None,
    sinks: Optional[torch.Tensor] = None,
    num_splits: Optional[int] = None,
    config: Optional[dict] = None,
) -> torch.Tensor:
    """Triton launcher of :func:`tree_attention` (validates, then launches).

    ``num_splits`` (key-axis splits, any ``>= 1``: splits past the work are
    empty) and ``config`` (one of :func:`tree_attention_configs`) override the
    launcher's choice; tests use them to run every code path.
    """
    inputs = _check_attention_inputs(query, key, value, bits, prefix_len, positions, window, softcap, sinks)
    return _launch(inputs, scale, window, softcap, sinks, num_splits, config)


def _batch_stride(x: torch.Tensor) -> int:
    """The batch stride the kernel gets: 0 for one row (never used; so a call of one row launches the same binary
    whatever layout its tensors had), else the tensor's."""
    return x.stride(0) if x.shape[0] > 1 else 0


def _check_kv_offsets(k: torch.Tensor, v: torch.Tensor, block_n: int, block_d: int) -> None:
    """The attention kernel's K / V element offsets within one kv head are int32 (its batch row and head
    offsets are int64): every one, masked lanes included (less than one key tile past the last key,
    ``BLOCK_D - 1`` past the head dim), is below ``(S + BLOCK_N) * stride_s + BLOCK_D * stride_d``, which must
    stay below 2^31."""
    for name, x in (("key", k), ("value", v)):
        extent = (x.shape[2] + block_n) * x.stride(2) + block_d * x.stride(3)
        if extent >= 2**31:
            raise ValueError(
                f"tree_attention: {name} spans {extent} elements within one kv head ((S + {block_n}) * "
                f"stride {x.stride(2)} + {block_d} * stride {x.stride(3)}), past the kernel's int32 offsets "
                f"(2^31); use a layout with the keys of one head closer together, e.g. [b, Hkv, S, D] views")


def _key_tiles(host_prefix: int, n_tree: int, window: Optional[int], block_n: int) -> int:
    """Key tiles a row tile can walk: the prefix within reach of a window (all of it without one), then the tree."""
    visible_prefix = host_prefix if window is None else min(host_prefix, window + n_tree)
    return _cdiv(visible_prefix, block_n) + _cdiv(n_tree, block_n)


def tree_attention_plan(query: torch.Tensor, key: torch.Tensor, prefix_len, window: Optional[int] = None
                        ) -> Tuple[dict, int]:
    """``(config, num_splits)`` the Triton launcher picks for these shapes (a benchmark's report): ``query [b, Hq,
    T, D]`` / ``[Hq, T, D]``, ``key [b, Hkv, S, D]`` / ``[Hkv, S, D]``, ``prefix_len`` an int or a device tensor
    (then ``S - T``, as the launcher sizes it)."""
    hq, n_tree, head_dim = query.shape[-3:]
    b = query.shape[0] if query.dim() == 4 else 1
    hkv = key.shape[-3]
    cfg = tree_attention_config(head_dim, query.dtype, n_tree * (hq // hkv), device_arch(query.device))
    host_prefix = key.shape[-2] - n_tree if isinstance(prefix_len, torch.Tensor) else prefix_len
    programs = _cdiv(n_tree * (hq // hkv), cfg["BLOCK_M"]) * b * hkv
    return cfg, _auto_num_splits(query.device, programs, _key_tiles(host_prefix, n_tree, window, cfg["BLOCK_N"]))


def _launch(inputs: _Inputs, scale, window, softcap=None, sinks=None, num_splits=None, config=None):
    q, k, v, bits, positions, prefix_len = inputs[:6]
    b, hq, n_tree, head_dim = q.shape
    hkv = k.shape[1]
    group = hq // hkv
    n_rows = n_tree * group
    device = q.device
    scale = head_dim**-0.5 if scale is None else float(scale)
    if scale < 0:  # softmax(q k * scale) = softmax(-q k * -scale), exactly (negation is exact in every dtype)
        q, scale = -q, -scale
    cfg = config or tree_attention_config(head_dim, q.dtype, n_rows, device_arch(device))
    block_m, block_n, block_d = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_D"]
    if block_n % 32 != 0 or block_m < 16 or block_d < head_dim:
        raise ValueError(f"tree_attention: config needs BLOCK_N % 32 == 0, BLOCK_M >= 16, BLOCK_D >= D, got {cfg}")
    _check_kv_offsets(k, v, block_n, block_d)
    out = torch.empty(b, hq, n_tree, head_dim, dtype=q.dtype, device=device)
    if n_tree == 0 or b == 0:
        return out if inputs.batched else out[0]
    row_tiles = _cdiv(n_rows, block_m)
    in_memory = isinstance(prefix_len, torch.Tensor)
    # The static form sizes the split count for the largest prefix the cache holds (S_max - T).
    host_prefix = k.shape[2] - n_tree if in_memory else prefix_len
    if num_splits is None:
        num_splits = _auto_num_splits(device, row_tiles * b * hkv, _key_tiles(host_prefix, n_tree, window, block_n))
    if not isinstance(num_splits, int) or num_splits < 1:
        raise ValueError(f"tree_attention: num_splits must be an int >= 1, got {num_splits!r}")

    chain = bits is None
    if chain:
        bits = _placeholder(device, torch.int32).view(1, 1, 1)
    window_arg = 1 if window is None else min(window, 2**30)  # an i32 argument; wider windows hide nothing more
    if window is None:
        pos = _placeholder(device, torch.int64).view(1, 1)
    elif positions is not None:
        pos = positions
    elif in_memory:  # default positions p_r + arange(T), formed on the device (no host read)
        pos = prefix_len.to(torch.int64)[:, None] + torch.arange(n_tree, device=device)
    else:
        pos = torch.arange(prefix_len, prefix_len + n_tree, device=device)[None].expand(b, n_tree)
    if num_splits > 1:
        part_out = torch.empty(num_splits, b * hkv, n_rows, block_d, dtype=torch.float32, device=device)
        part_lse = torch.empty(num_splits, b * hkv, n_rows, dtype=torch.float32, device=device)
    else:
        part_out = part_lse = _placeholder(device, torch.float32)
    if softcap is None:
        qk_scale, softcap_scale = scale * _LOG2E, 1.0
    else:  # c * tanh(s / c) in base 2: tanh(qk * (scale / c)) * (c * log2 e)
        softcap = float(softcap)
        qk_scale, softcap_scale = scale / softcap, softcap * _LOG2E
    has_sinks = sinks is not None
    if sinks is None:
        sinks = _placeholder(device, torch.float32)
    elif sinks.stride(0) != 1:
        sinks = sinks.contiguous()
    if in_memory:
        prefix_ptr, prefix_arg = prefix_len, 0
    else:
        prefix_ptr, prefix_arg = _placeholder(device, torch.int64), prefix_len
    _tree_attention_kernel[(row_tiles, b * hkv, num_splits)](
        q, k, v, bits, pos, sinks, prefix_ptr, out, part_out, part_lse,
        _batch_stride(q), q.stride(1), q.stride(2), q.stride(3),
        _batch_stride(k), k.stride(1), k.stride(2), k.stride(3),
        _batch_stride(v), v.stride(1), v.stride(2), v.stride(3),
        bits.stride(0), bits.stride(1), bits.stride(2), pos.stride(0), pos.stride(1), prefix_ptr.stride(0),
        _batch_stride(out), out.stride(1), out.stride(2), out.stride(3),
        n_tree, prefix_arg, window_arg, hkv, group, qk_scale, softcap_scale,
        HEAD_DIM=head_dim, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d,
        CHAIN=chain, WINDOW=window is not None, SPLIT_KEYS=num_splits > 1,
        HAS_SOFTCAP=softcap is not None, HAS_SINKS=has_sinks,
        DOT_FP32=triton_interpreting(), INPUT_PRECISION=_input_precision(q.dtype), PREFIX_IN_MEMORY=in_memory,
        UNMASKED_PREFIX=cfg.get("UNMASKED_PREFIX", True),
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], maxnreg=cfg.get("maxnreg"),
    )
    if num_splits > 1:
        _merge_splits_kernel[(_cdiv(n_rows, MERGE_BLOCK_M), b * hkv)](
            part_out, part_lse, sinks, out, n_tree, hkv, group, num_splits,
            _batch_stride(out), out.stride(1), out.stride(2), out.stride(3),
            HEAD_DIM=head_dim, BLOCK_M=MERGE_BLOCK_M, BLOCK_D=block_d, HAS_SINKS=has_sinks,
            num_warps=MERGE_NUM_WARPS,
        )
    return out if inputs.batched else out[0]


def tree_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    bits: Optional[torch.Tensor],
    prefix_len: int,
    scale: Optional[float] = None,
    *,
    positions: Optional[torch.Tensor] = None,
    window: Optional[int] = None,
    softcap: Optional[float] = None,
    sinks: Optional[torch.Tensor] = None,
    backend: Optional[str] = None,
) -> torch.Tensor:
    """Attention of T query tokens over ``[prefix ; tree]`` keys, for one sequence or a batch of ``b``.

    Args:
        query: ``[Hq, T, D]`` (one sequence) or ``[b, Hq, T, D]`` (``b``
            independent sequences, "rows"), T tokens in node order.
        key, value: ``[Hkv, S, D]`` or ``[b, Hkv, S, D]`` (the query's ``b``;
            without a batch dim only with ``b = 1``), ``S = prefix_len + T``;
            any strides (e.g. ``cache[l, 0, :, :S]`` of a ``[L, 2, Hkv, Smax, D]``
            buffer, or ``kv[:, l, 0]`` of a ``[b, L, 2, Hkv, Smax, D]`` one,
            whose batch stride may pass 2^31 elements): nothing is copied;
            the Triton kernel addresses one kv head's keys with int32
            offsets: ``(S + 64) * stride(-2) + 256 * stride(-1) < 2^31``
            always suffices (a longer span is refused).
            ``Hq % Hkv == 0``; query head ``h`` reads kv head ``h // (Hq //
            Hkv)``. ``1 <= D <= 256``.
        bits: ``[T, >= ceil(T/32)]`` int32 bitmask (tree key ``j`` visible to
            query ``i`` iff bit ``j`` of row ``i``: :func:`ancestor_bits`, or all
            ones for a non-causal block), the same tree for every batch row;
            or ``[b, T, >= ceil(T/32)]``, a tree per row; or None for a causal
            chain (``j <= i``; no bitmask is read).
        prefix_len: keys before the tree keys, visible to every query (subject
            to the window); an int is every row's. Or an int64 (int32) tensor
            ``[b]`` (``[1]`` / ``[]`` also for one row) on the query's device (a
            compiled / CUDA-graph step), row ``r``'s committed length ``p_r``:
            then key/value are the whole cache views ``[b, Hkv, S_max, D]``,
            ``S_max >= p_r + T`` (not checked: that would read ``p``), row
            ``r``'s pass rows at ``[p_r, p_r + T)``, its rows ``>= p_r + T``
            never read (NaN / inf there cannot reach the output). The launch
            (grid, split count, binary) depends on ``b``, ``T`` and ``S_max``
            only and ``p`` is read in-kernel, so a CUDA graph of the call
            replays for any ``p``.
        scale: softmax scale, default ``D ** -0.5``.
        positions: ``[T]`` (every row's) or ``[b, T]`` (per row) int32/int64
            absolute positions of the tree tokens on the query's device
            (default row ``r``'s ``p_r + arange(T)``); prefix key ``k`` sits
            at position ``k``. Only read with ``window``.
        window: None or an int ``>= 1``: also hide key ``k`` from query ``i`` when
            ``pos_q(i) - pos_k(k) >= window`` (later keys are never hidden by it);
            prefix tiles outside every query's window are not read at all.
        softcap: None or a finite float ``c > 0``: every score ``s = q.k * scale``
            becomes ``c * tanh(s / c)`` before the mask and the softmax (Gemma 2's
            ``attn_logit_softcapping``).
        sinks: None or a ``[Hq]`` float tensor (any float dtype) on the query's
            device, every row's: one extra logit per query head in the softmax denominator
            only (gpt-oss's ``sinks``): ``out_i = sum_j e^(s_ij - m) v_j /
            (e^(sink_h - m) + sum_j e^(s_ij - m))``, ``m`` the max over the
            visible scores and the sink. A row that sees no key outputs 0 (as
            transformers' eager gpt-oss attention does, its sink taking all the
            weight).
        backend: 'triton' or 'reference' to fix the backend (a compiled round
            does), None: :func:`dflash_kernels.get_backend`.

    Returns:
        ``softmax(q k^T * scale + mask) v`` (capped / with the sink column as
        above) in the query's dtype and rank (``[b, Hq, T, D]`` for a batch:
        row ``r`` is the call on row ``r``'s query, key, value, prefix, bits
        and positions; with ``b = 1`` exactly the single-row call's values),
        accumulated in float32, with the visibility of
        :func:`dflash_kernels.reference.tree_visibility`. fp16/bf16/fp32. No
        host synchronization: only shapes are read on the host.
    """
    inputs = _check_attention_inputs(query, key, value, bits, prefix_len, positions, window, softcap, sinks)

    def traced():
        op = torch.ops.dflash.tree_attention
        op = op.tensor if isinstance(prefix_len, torch.Tensor) else op.default
        return op(query, key, value, bits, prefix_len, scale, positions, window, softcap, sinks)

    return dispatch(
        backend, query.device, traced=traced, triton=lambda: _launch(inputs, scale, window, softcap, sinks),
        reference=lambda: _reference.tree_attention(query, key, value, bits, prefix_len, scale, positions=positions,
                                                    window=window, softcap=softcap, sinks=sinks))


def _query_shaped(a) -> Tensor:
    """The shape rule of ``tree_attention``'s overloads: the output has the query's shape and dtype."""
    return a.query.new_empty(a.query.shape)


@declare("tree_attention", fake=_query_shaped)
def _tree_attention_op(query: Tensor, key: Tensor, value: Tensor, bits: Optional[Tensor], prefix_len: int,
                       scale: Optional[float] = None, positions: Optional[Tensor] = None,
                       window: Optional[int] = None, softcap: Optional[float] = None,
                       sinks: Optional[Tensor] = None) -> Tensor:
    """:func:`tree_attention`: query-shaped output in the query's dtype (``[Hq, T, D]`` or ``[b, Hq, T, D]`` for a
    batch of ``b`` rows; K/V any strides, e.g. views of the cache: read, never copied or written)."""
    return tree_attention(query, key, value, bits, prefix_len, scale, positions=positions, window=window,
                          softcap=softcap, sinks=sinks)


@declare("tree_attention.tensor", fake=_query_shaped)
def _tree_attention_tensor_op(query: Tensor, key: Tensor, value: Tensor, bits: Optional[Tensor], prefix_len: Tensor,
                              scale: Optional[float] = None, positions: Optional[Tensor] = None,
                              window: Optional[int] = None, softcap: Optional[float] = None,
                              sinks: Optional[Tensor] = None) -> Tensor:
    """:func:`tree_attention` with the committed lengths ``prefix_len`` an int64 device tensor ``[b]`` (``[1]`` /
    ``[]`` for one row; read in-kernel), K/V the whole cache views ``[b, Hkv, S_max, D]`` (or ``[Hkv, S_max,
    D]``); query-shaped output."""
    return tree_attention(query, key, value, bits, prefix_len, scale, positions=positions, window=window,
                          softcap=softcap, sinks=sinks)


def tree_visibility(bits: Optional[torch.Tensor], prefix_len, n_tree: int, *, n_keys: Optional[int] = None,
                    positions: Optional[torch.Tensor] = None, window: Optional[int] = None,
                    device=None) -> torch.Tensor:
    """Which keys each of a pass's ``T = n_tree`` rows sees: bool ``[T, prefix_len + T]``, or ``[T, n_keys]``
    over a whole cache of ``n_keys = S_max`` rows when ``prefix_len`` is a device tensor ``[1]``.

    Batched, ``[b, T, ...]``, when any input is per batch row: ``bits [b, T, W]``, ``positions [b, T]`` or a
    device ``prefix_len [b]`` (``b > 1``; the others shared by every row).

    The rule of :func:`tree_attention` (:func:`dflash_kernels.reference.tree_visibility`; ``bits=None``: a
    causal chain), in fixed-shape torch ops on every backend. A pass computes it once per distinct window and
    every layer reuses it (:func:`masked_attention`).
    """
    return _reference.tree_visibility(bits, prefix_len, n_tree, positions=positions, window=window, device=device,
                                      n_keys=n_keys)


def masked_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, visible: torch.Tensor, *,
                     scale: Optional[float] = None) -> torch.Tensor:
    """Attention of a pass over the whole cache with a precomputed ``visible [T, S]`` (:func:`tree_visibility`).

    ``query [b, Hq, T, D]`` or ``[Hq, T, D]``, ``key/value [b, Hkv, S, D]`` or
    ``[Hkv, S, D]`` (GQA: ``Hq % Hkv == 0``), ``visible [T, S]`` (every batch
    row's) or ``[b, T, S]`` (a row each): ``softmax(q k^T * scale +
    where(visible, 0, -inf)) v``, SDPA with the boolean mask in the model's
    dtype, as the eager reference path runs it. Rows past the pass's keys get
    weight 0; they hold zeros or stale finite values of earlier passes (the
    caches are zero-initialized and only ever written with K/V). Pure torch on
    every backend (traced inline by ``torch.compile``).
    """
    if query.dim() == 3:  # [Hq, T, D] (the drafter's layout)
        return masked_attention(query[None], key[None], value[None], visible, scale=scale)[0]
    if visible is not None and visible.dim() == 3:  # a mask per batch row, broadcast over the heads
        visible = visible[:, None]
    return torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=visible, scale=scale,
                                                            enable_gqa=True)


def warmup_tree_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    bits: Optional[torch.Tensor],
    prefix_len: int,
    scale: Optional[float] = None,
    *,
    positions: Optional[torch.Tensor] = None,
    window: Optional[int] = None,
    softcap: Optional[float] = None,
    sinks: Optional[torch.Tensor] = None,
) -> None:
    """Compile (by running) every kernel variant :func:`tree_attention` can pick at these shapes.

    The binaries depend on the dtype, head dim, row count bucket (``T * G``),
    the chain / window / softcap / sinks flags and whether the key axis is
    split, never on ``prefix_len``, ``T`` within its bucket, the window size,
    the softcap value, the sinks' values, the split count, the batch size
    (see ``TREE_ATTENTION_DYNAMIC_INTS`` for its strides) or whether bits /
    positions are shared or per row; so one unsplit
    and one split launch (plus the merge kernel) cover a generation that
    keeps these flags and shapes. A no-op on the reference backend.
    """
    inputs = _check_attention_inputs(query, key, value, bits, prefix_len, positions, window, softcap, sinks)
    if get_backend(query.device) != "triton":
        return
    for num_splits in (1, 2):
        _launch(inputs, scale, window, softcap, sinks, num_splits=num_splits)
