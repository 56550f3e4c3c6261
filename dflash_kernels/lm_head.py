"""Final RMSNorm + lm_head at selected positions, fused with what consumes the logits.

Shapes: ``hidden [T, H]``, ``weight [V, H]`` (lm_head), ``norm_weight [H]``
(optional final RMSNorm), ``positions [N]`` (rows of ``hidden``; None = all).
The math is :mod:`dflash_kernels.reference.lm_head` (HF RMSNorm, then
``logits = a @ weight.T`` accumulated in fp32); this module computes it without
ever holding more than one chunk of the ``[N, V]`` logits.

Pipeline (Triton backend):

1. ``_norm_rows_kernel`` (a few selected rows per program): gathers
   ``hidden[positions]``, applies the RMSNorm with HF's roundings (statistics in
   fp32, ``x_normed`` cast to the hidden dtype, times ``norm_weight``, cast to
   the hidden dtype) and writes the GEMM operand ``a [N, H]`` in the *dot
   dtype*. Skipped when there is nothing to do (no norm, no positions, dtypes
   already match). The norm lives in this prologue pass rather than in the
   GEMM main loop because every vocab tile would otherwise redo it: ``a`` is
   ``N*H`` elements, negligible next to the ``V*H`` weight the GEMM streams.
2. A tiled GEMM over (position tiles x vocab tiles), ``weight`` read in its own
   dtype, ``tl.dot`` on bf16/fp16 tensor cores with fp32 accumulation, and an
   epilogue chosen by the op:

   * argmax (``_argmax_kernel``, one launch): the fp32 accumulator is first rounded to
     the logits' dtype (``logit_dtype``, default the dtype ``F.linear`` returns: bf16
     for a bf16 model, round to nearest even as a bf16 GEMM writes its output, so the
     choice is transformers' ``argmax`` of the bf16 logits; fp32: no rounding). The
     grid is (row tiles x vocab splits), each split a contiguous run of vocab tiles
     (:func:`vocab_split_plan`: one wave of ``2 * SMs`` programs); a program folds its
     tiles into a running per-row (max, lowest id of the max) in registers, writes
     that ``[N, n_splits]`` partial, and the last program of a row tile to take an
     atomic ticket merges the splits in order (lowest id on ties) and writes the
     int64 ids. No logits are stored, no other launch follows. bf16/fp16 row tiles
     (:func:`head_config`): 16 up to 16 rows, else 64 or 128, whichever pads less
     (257 rows: 320 rows of tensor-core work with 64, not 384 with 128).
   * sample: the same with Gumbel-max on the rounded logits:
     ``argmax(logits / T + G)``, ``G =
     -log(-log(U))``, ``U`` from Philox keyed by a seed and counted by
     ``row * V + vocab_id``, generated in-kernel (no ``[N, V]`` noise tensor).
     Reproducible for a given seed whatever the tiling.
     Device seed (``seed`` an int64 tensor ``[1]``, for a compiled /
     CUDA-graph step): every program loads the seed from
     memory and draws ``G[n, j] = -log(E)``, ``E = -log(1 - e)``, ``e`` from
     Philox-4x32-10 with key = the seed's 64 bits and counter ``(j, n, 0, 0)``
     (:func:`dflash_kernels.noise.philox_gumbel`): the same noise as
     :func:`dflash_kernels.reference.gumbel_noise`, a pure function of
     (seed value, output row, vocab id), one launch for all rows.
   * top-K (``_topk_kernel``, one launch, ``k <= TOPK_FUSED_MAX``: 256, fp32 64): the argmax grid;
     each program keeps its rows' ``next_power_of_2(k)`` largest keys in registers
     (fp32 logit order bits over the complement of the vocab id, so ties go to the
     lower id) with bitonic compare-and-swap networks (:mod:`dflash_kernels._bitonic`), plus a
     running (max, sum exp), and writes them per split; one ``torch.topk`` over the
     splits' keys and the logsumexp of their partials finish it. No logits are stored.
   * logits: stores one chunk of fp32 logits, plus per-tile row max and
     ``sum(exp(x - max))`` partials from which the chunk's logsumexp follows.
     Top-K wider than that merges each chunk into a running top-K
     with ``torch.topk`` and a running logsumexp; the training cross-entropy
     (:mod:`dflash_kernels.cross_entropy`) consumes the same chunks.

   Final-logit softcap (``softcap = c``, Gemma 2 / 3): every epilogue first
   maps the fp32 accumulator to ``c * tanh(acc / c)`` (:func:`tanh_f32`),
   before the rounding to ``logit_dtype`` (argmax, sample), before the stored
   logits and their logsumexp partials (top-K, cross-entropy), before the top-K keys.

Dot dtype: the weight's dtype when ``hidden`` has the same dtype (the normal
case, tensor cores); otherwise fp32 with IEEE precision (so a mixed fp32-hidden
/ bf16-weight call equals the fp32 reference). Under Triton's CPU interpreter
``DOT_FP32`` is always on (the interpreter's bf16 dot is wrong), which only
changes how exact products are summed.

Launch configs come from small fixed tables (:func:`gemm_config`, :func:`head_config`,
:func:`norm_config`); :func:`launch_configs` lists
every distinct compiled variant for real model shapes (the GPU compile test
enumerates it). Integer arguments that change between calls (row counts,
vocab chunk bounds, row offsets, seeds: :data:`DO_NOT_SPECIALIZE`) are
``do_not_specialize``, so a generation never recompiles mid-way.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import torch
import triton
import triton.language as tl

from torch import Tensor

from ._bitonic import merge_top, top_desc
from ._declare import declare, dispatch
from ._dispatch import DEFAULT_ARCH, device_arch, multiprocessor_count, triton_interpreting
from .noise import DO_NOT_SPECIALIZE as NOISE_DO_NOT_SPECIALIZE
from .noise import NOISE_BLOCK_C, NOISE_BLOCK_R, NOISE_NUM_WARPS
from .noise import UNALIGNED_PTRS as NOISE_UNALIGNED_PTRS
from .noise import _gumbel_noise_kernel, philox_gumbel
from .reference import lm_head as _reference
from .reference.lm_head import (HeadInputs, check_k, check_seed_tensor, check_temperature, head_inputs,
                                resolve_logit_dtype, seed_from)
# float32 tanh from exp (a few ulps; the interpreter has no tanh): the final-logit softcap
from .tree_attention import tanh_f32

__all__ = [
    "lm_head_logits",
    "lm_head_argmax",
    "lm_head_topk",
]


# Largest number of fp32 logits one chunk may hold (top-K and the training cross-entropy):
# 2**25 elements = 128 MiB of fp32 logits.
DEFAULT_CHUNK_ELEMENTS = 1 << 25

_INT32_MAX = 2 ** 31 - 1
_SEED_MOD = 2 ** 61


def next_power_of_2(x: int) -> int:
    return 1 if x <= 1 else 1 << (int(x) - 1).bit_length()


# --------------------------------------------------------------------------- configs


def dot_dtype_for(hidden_dtype: torch.dtype, weight_dtype: torch.dtype) -> torch.dtype:
    """The dtype of the GEMM operands: the weight's when hidden matches it, else fp32."""
    return weight_dtype if hidden_dtype == weight_dtype else torch.float32


#: Register cap passed with every bf16/fp16 GEMM launch: without it ptxas 13 caps the 16-row tiles
#: at 64-72 registers and spills to a stack frame (the AOT compile shows it); the fp32 tiles compile
#: without a stack frame only without it.
GEMM_MAXNREG = 255


def gemm_maxnreg(dot_dtype: torch.dtype) -> Optional[int]:
    return None if dot_dtype == torch.float32 else GEMM_MAXNREG


def gemm_config(n_rows: int, dot_dtype: torch.dtype) -> Dict[str, int]:
    """Tile sizes and launch parameters of the logits kernel (top-K, cross-entropy) for ``n_rows`` positions.

    Two row tiles per dtype. Decode-sized calls (<= 16 rows: a DFlash block,
    a DDTree draft) use 16-row tiles that stream the weight with deep
    pipelining (the call is bound by reading ``V*H`` weight bytes); anything
    larger uses 128-row tiles (wgmma on sm_90). fp32 (IEEE dot) uses narrower
    tiles. All fit the sm_80 shared-memory limit.
    """
    if dot_dtype == torch.float32:
        if n_rows <= 16:
            return dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=64, GROUP_M=8, num_warps=4, num_stages=3)
        return dict(BLOCK_M=128, BLOCK_N=64, BLOCK_K=32, GROUP_M=8, num_warps=8, num_stages=3)
    if n_rows <= 16:
        return dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, GROUP_M=8, num_warps=4, num_stages=4)
    return dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=3)


#: Row tiles of the heads' kernel (argmax / Gumbel sampling) above 16 rows, largest first.
HEAD_ROW_TILES = (128, 64)


def head_config(n_rows: int, dot_dtype: torch.dtype, gumbel: bool = False) -> Dict[str, int]:
    """Tiles of :func:`_argmax_kernel` (greedy and Gumbel heads) for ``n_rows`` positions.

    <= 16 rows: the decode tile of :func:`gemm_config` (16 rows, weight-read bound). Above: the row tile
    of :data:`HEAD_ROW_TILES` with the fewest padded rows, ties to the larger (fewer re-reads of each
    weight tile): 257 rows run as 5 x 64 = 320 rows of tensor-core work instead of 3 x 128 = 384;
    65 -> 2 x 64 = 128 = 1 x 128 -> 128. bf16/fp16: 8 warps, 128 vocab ids per tile (sm_90: two
    warpgroups of ``wgmma m64n64k16`` at 64 rows, of ``m64n128k16`` at 128 rows), except the Gumbel
    epilogue at 128 rows, 64 ids wide (``m64n64k16``): its Philox noise spills a 128 x 128 tile (and a
    64 x 128 tile with 4 warps). fp32 (IEEE dot, not a speed path): one 64 x 32 tile, 4 warps, no register
    cap, at every row count: the shape found to compile without a stack frame on sm_80 and sm_90 with both
    supported Tritons (16-row fp32 tiles kept an 8-16 B frame on one of them).
    ``BLOCK_S``: partials merged per step by the last program.
    """
    if dot_dtype == torch.float32:
        return dict(BLOCK_M=64, BLOCK_N=32, BLOCK_K=32, BLOCK_S=32, num_warps=4, num_stages=3, maxnreg=None)
    if n_rows <= 16:
        return dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, BLOCK_S=32, num_warps=4, num_stages=4, maxnreg=GEMM_MAXNREG)
    block_m = min(HEAD_ROW_TILES, key=lambda m: (triton.cdiv(n_rows, m) * m, -m))
    block_n = 64 if gumbel and block_m == 128 else 128
    return dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=64, BLOCK_S=32, num_warps=8, num_stages=3,
                maxnreg=GEMM_MAXNREG)


#: The largest ``next_power_of_2(k)`` the fused top-K kernel keeps in registers, by dot dtype (the widest tiles
#: that compile without spills on sm_80 and sm_90); a larger k takes the chunked path (fp32 logits in chunks of
#: ``chunk_elements``, merged with ``torch.topk``).
TOPK_FUSED_MAX = {torch.bfloat16: 256, torch.float16: 256, torch.float32: 64}
#: Top-K widths of real drafts (DDTree's K = min(budget, V): the auto budgets' 8 and 64, budgets of 128 and
#: 256): the compile tests list each one the fused kernel takes.
REAL_TOPK = (8, 64, 128, 256)


def topk_fused_max(dot_dtype: torch.dtype) -> int:
    """:data:`TOPK_FUSED_MAX` for a GEMM in ``dot_dtype``."""
    return TOPK_FUSED_MAX[dot_dtype]


def topk_config(n_rows: int, dot_dtype: torch.dtype, k: int, arch: int = DEFAULT_ARCH) -> Dict[str, int]:
    """Tiles of :func:`_topk_kernel` for ``n_rows`` positions and ``k <= topk_fused_max(dot_dtype)`` on GPU
    architecture ``arch`` (``major * 10 + minor``).

    ``K_BLOCK = next_power_of_2(k)`` running keys per row; vocab tiles at least that wide (a tile's top
    K_BLOCK must exist). bf16/fp16: up to 16 rows the decode tile, 16 x 64 ids (weight-read bound; the
    bitonic work per id is the same at 64 and 128 ids: ``log K (log K + 1) / 2`` stages over the tile,
    ``log K + 1`` per halving and for the merge), 16 x 128 with 64-deep K steps for 128 keys; above, on
    sm_90 64 x 128 with 8 warps (``wgmma m64n64k16`` per warpgroup), elsewhere 32 x 128 with 8 warps
    (sm_80's 64 x 128 spills 16-96 B with triton 3.6). 256 keys: 16 x 256 with 8 warps at every row count
    (wider row tiles spill). fp32 (IEEE dot, not a speed path): 16 x 64, 8 warps, 2 stages. Every choice
    is one that compiles with no stack frame on sm_80 and sm_90 with both supported Tritons (their
    neighbours often keep an 8-32 B frame).
    """
    kb = next_power_of_2(k)
    if kb > topk_fused_max(dot_dtype):
        raise ValueError(f"the fused top-K keeps at most {topk_fused_max(dot_dtype)} keys per row with a "
                         f"{str(dot_dtype).replace('torch.', '')} GEMM, got k = {k}")
    if dot_dtype == torch.float32:
        return dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=32, K_BLOCK=kb, num_warps=8, num_stages=2, maxnreg=None)
    if kb == 256:
        return dict(BLOCK_M=16, BLOCK_N=256, BLOCK_K=64, K_BLOCK=kb, num_warps=8, num_stages=3, maxnreg=GEMM_MAXNREG)
    if n_rows <= 16 and kb == 128:
        return dict(BLOCK_M=16, BLOCK_N=128, BLOCK_K=64, K_BLOCK=kb, num_warps=4, num_stages=3, maxnreg=GEMM_MAXNREG)
    if n_rows <= 16:
        return dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, K_BLOCK=kb, num_warps=4, num_stages=4, maxnreg=GEMM_MAXNREG)
    return dict(BLOCK_M=64 if arch // 10 == 9 else 32, BLOCK_N=max(128, kb), BLOCK_K=64, K_BLOCK=kb, num_warps=8,
                num_stages=3, maxnreg=GEMM_MAXNREG)


#: Resident programs per SM the heads' split plan aims at (sm_80 fits two 72 KiB pipelines of the 64 x 128
#: tile, sm_90 three): two, so one program's epilogue overlaps the other's main loop.
HEAD_PROGRAMS_PER_SM = 2
#: Programs the split plan aims at under Triton's interpreter (or on a device that is not CUDA): a few, so
#: every CPU test runs several splits and the ticket merge.
HEAD_PROGRAMS_CPU = 3


def _head_programs(device: torch.device) -> int:
    if device.type != "cuda" or triton_interpreting():
        return HEAD_PROGRAMS_CPU
    return HEAD_PROGRAMS_PER_SM * multiprocessor_count(device)


def vocab_split_plan(row_tiles: int, vocab_tiles: int, programs: int) -> Tuple[int, int]:
    """``(tiles_per_split, n_splits)``: each row tile's vocab tiles cut into contiguous splits so that
    ``row_tiles * n_splits <= max(programs, row_tiles)`` programs run as one wave, none empty.

    E.g. H200 / H100 (132 SMs, 264 programs), V = 151936: 257 rows (5 row tiles of 64, 1187 tiles of
    128 ids) -> 23 tiles per split, 52 splits, 260 programs; 15 rows (1 tile of 16, 2374 tiles of 64)
    -> 9 tiles per split, 264 splits.
    """
    splits = max(1, min(vocab_tiles, programs // max(1, row_tiles)))
    tiles_per_split = triton.cdiv(vocab_tiles, splits)
    return tiles_per_split, triton.cdiv(vocab_tiles, tiles_per_split)


def norm_config(hidden: int) -> Dict[str, int]:
    """BLOCK_R (rows per program), BLOCK_H and num_warps of the norm/gather prologue kernel."""
    block_h = min(1024, max(16, next_power_of_2(hidden)))
    return dict(BLOCK_R=max(1, 2048 // block_h), BLOCK_H=block_h, num_warps=4)


#: Integer kernel arguments that vary from call to call (the row count per
#: decoding round, vocab chunk bounds, row offsets, a fresh seed): declared
#: ``do_not_specialize`` so that they never select a new binary. Everything
#: else is fixed per model and call site (H, V, strides, tiles).
DO_NOT_SPECIALIZE = {
    "_norm_rows_kernel": ("N",),
    "_logits_kernel": ("N", "V0", "V_END", "stride_pm"),
    "_argmax_kernel": ("N", "seed", "tiles_per_split", "n_splits"),
    "_topk_kernel": ("N", "tiles_per_split", "n_splits"),
    **NOISE_DO_NOT_SPECIALIZE,
}


#: Pointer arguments that may be slices at any offset (a seed inside a bigger state buffer): never specialized
#: on 16-byte alignment, so a new offset never picks a new binary (they are read by one scalar load).
UNALIGNED_PTRS = {"_argmax_kernel": ("seed_ptr",), **NOISE_UNALIGNED_PTRS}


def _dot_fp32(dot_dtype: torch.dtype) -> bool:
    return dot_dtype == torch.float32 or triton_interpreting()


# --------------------------------------------------------------------------- kernels


@triton.jit
def _round_to(x, dtype: tl.constexpr, RNE_BF16: tl.constexpr):
    """fp32 ``x`` rounded to ``dtype`` (returned as fp32).

    With RNE_BF16 a bf16 target is rounded to nearest-even by bit
    arithmetic first, because Triton's interpreter truncates fp32->bf16
    casts; compiled code has RNE_BF16 off and uses the hardware cast.
    """
    if RNE_BF16 and dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        x = bits.to(tl.float32, bitcast=True)
    return x.to(dtype).to(tl.float32)

@triton.jit(do_not_specialize=DO_NOT_SPECIALIZE["_norm_rows_kernel"])
def _norm_rows_kernel(
    x_ptr,  # hidden [T, H], unit stride in the last dim
    stride_x,
    pos_ptr,  # int64 [N] rows of hidden (unused without HAS_POS)
    nw_ptr,  # norm weight [H] (unused without HAS_NORM)
    out_ptr,  # a [N, H] contiguous, in the dot dtype
    N,
    H,
    eps,
    HAS_POS: tl.constexpr,
    HAS_NORM: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_H: tl.constexpr,
    RNE_BF16: tl.constexpr,
):
    """a[r] = (nw * (x * rsqrt(mean(x^2) + eps)).to(x.dtype)).to(x.dtype), x = hidden[pos[r]]; BLOCK_R rows."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    r_mask = rows < N
    if HAS_POS:
        src = tl.load(pos_ptr + rows, mask=r_mask, other=0)
    else:
        src = rows
    x_rows = x_ptr + src[:, None] * stride_x
    o_rows = out_ptr + rows[:, None] * H
    in_ty = x_ptr.dtype.element_ty
    offs = tl.arange(0, BLOCK_H)
    rstd = tl.zeros([BLOCK_R], dtype=tl.float32)
    if HAS_NORM:
        sq = tl.zeros([BLOCK_R, BLOCK_H], dtype=tl.float32)
        for k0 in range(0, H, BLOCK_H):
            mask = r_mask[:, None] & (k0 + offs < H)[None, :]
            x = tl.load(x_rows + k0 + offs[None, :], mask=mask, other=0.0).to(tl.float32)
            sq += x * x
        rstd = 1.0 / tl.sqrt_rn(tl.sum(sq, axis=1) / H + eps)
    for k0 in range(0, H, BLOCK_H):
        h_mask = k0 + offs < H
        mask = r_mask[:, None] & h_mask[None, :]
        x = tl.load(x_rows + k0 + offs[None, :], mask=mask, other=0.0).to(tl.float32)
        if HAS_NORM:
            w = tl.load(nw_ptr + k0 + offs, mask=h_mask, other=0.0).to(tl.float32)
            x = _round_to(w[None, :] * _round_to(x * rstd[:, None], in_ty, RNE_BF16), in_ty, RNE_BF16)
        tl.store(o_rows + k0 + offs[None, :], x.to(out_ptr.dtype.element_ty), mask=mask)

@triton.jit
def _tile_coords(N, n_cols, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """(row tile, vocab tile) of this program; GROUP_M row tiles share a band of weight tiles in L2."""
    pid = tl.program_id(0)
    num_m = tl.cdiv(N, BLOCK_M)
    num_n = tl.cdiv(n_cols, BLOCK_N)
    width = GROUP_M * num_n
    group = pid // width
    first_m = group * GROUP_M
    size_m = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % width) % size_m
    pid_n = (pid % width) // size_m
    return pid_m, pid_n

@triton.jit
def _tile_logits(a_ptr, stride_am, w_ptr, stride_wn, N, V_END, H, offs_m, offs_n, softcap,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 DOT_FP32: tl.constexpr, HAS_SOFTCAP: tl.constexpr):
    """fp32 [BLOCK_M, BLOCK_N] tile of the logits ``a @ w.T`` (rows offs_m < N, vocab ids offs_n < V_END), or
    ``softcap * tanh(logits / softcap)`` with HAS_SOFTCAP (the final-logit softcap, on the fp32 accumulator)."""
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m < N
    n_mask = offs_n < V_END
    a_ptrs = a_ptr + offs_m[:, None].to(tl.int64) * stride_am + offs_k[None, :]
    w_ptrs = w_ptr + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        k_mask = offs_k < H - k0
        a = tl.load(a_ptrs, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        if DOT_FP32:
            acc = tl.dot(a.to(tl.float32), w.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(a, w, acc)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if HAS_SOFTCAP:
        acc = tanh_f32(acc / softcap) * softcap
    return acc

# row count, vocab chunk bounds and the partials' row stride (tiles per chunk) vary per call
@triton.jit(do_not_specialize=DO_NOT_SPECIALIZE["_logits_kernel"])
def _logits_kernel(
    a_ptr, stride_am,  # a [N, H] (dot dtype)
    w_ptr, stride_wn,  # weight [V, H]
    out_ptr, stride_om,  # fp32 logits chunk [N, V_END - V0]
    pmax_ptr, psum_ptr, stride_pm,  # fp32 [N, n_tiles] logsumexp partials
    N, V0, V_END, H,
    softcap,  # HAS_SOFTCAP only: logits = softcap * tanh(acc / softcap)
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    DOT_FP32: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
):
    """out[:, j] = logits[:, V0 + j]; per tile t: pmax = max_j, psum = sum_j exp(logit - pmax).

    ``logits = acc`` (fp32 ``a @ w.T``), or ``softcap * tanh(acc / softcap)`` with HAS_SOFTCAP.
    """
    pid_m, pid_n = _tile_coords(N, V_END - V0, BLOCK_M, BLOCK_N, GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = V0 + pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = _tile_logits(a_ptr, stride_am, w_ptr, stride_wn, N, V_END, H, offs_m, offs_n, softcap,
                       BLOCK_M, BLOCK_N, BLOCK_K, DOT_FP32, HAS_SOFTCAP)
    m_mask = offs_m < N
    n_mask = offs_n < V_END
    rows64 = offs_m.to(tl.int64)
    out_ptrs = out_ptr + rows64[:, None] * stride_om + (offs_n - V0)[None, :]
    tl.store(out_ptrs, acc, mask=m_mask[:, None] & n_mask[None, :])
    x = tl.where(n_mask[None, :], acc, float("-inf"))
    row_max = tl.max(x, axis=1)
    row_sum = tl.sum(tl.exp(x - row_max[:, None]), axis=1)
    tl.store(pmax_ptr + rows64 * stride_pm + pid_n, row_max, mask=m_mask)
    tl.store(psum_ptr + rows64 * stride_pm + pid_n, row_sum, mask=m_mask)

@triton.jit
def _split_program(N, V, tiles_per_split, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """This program's place in a split heads' grid (:func:`vocab_split_plan`): ``(row tile, split, its rows
    [BLOCK_M], first vocab tile, end vocab tile)``. Row tiles vary fastest, so the programs reading one
    weight slice run side by side and share it in L2; split ``s`` walks vocab tiles
    ``[s * tiles_per_split, min((s + 1) * tiles_per_split, cdiv(V, BLOCK_N)))``."""
    pid = tl.program_id(0)
    num_m = tl.cdiv(N, BLOCK_M)
    pid_m = pid % num_m
    split = pid // num_m
    tile0 = split * tiles_per_split
    return (pid_m, split, pid_m * BLOCK_M + tl.arange(0, BLOCK_M), tile0,
            tl.minimum(tile0 + tiles_per_split, tl.cdiv(V, BLOCK_N)))


# a fresh seed per call, the row count (it varies per decoding round) and the split plan must not recompile
@triton.jit(do_not_specialize=DO_NOT_SPECIALIZE["_argmax_kernel"],
            do_not_specialize_on_alignment=UNALIGNED_PTRS["_argmax_kernel"])
def _argmax_kernel(
    a_ptr, stride_am,  # a [N, H] (dot dtype)
    w_ptr, stride_wn,  # weight [V, H]
    pval_ptr, pidx_ptr,  # fp32 / int32 [N, n_splits]: per-split best score and its vocab id
    ticket_ptr,  # int32 [>= row tiles], zero before and after every launch: splits done per row tile
    out_ptr,  # int64 [N]: the chosen vocab ids
    N, V, H,
    tiles_per_split, n_splits,  # vocab tiles per split (the last one may have fewer), splits
    inv_temperature,  # GUMBEL only
    seed,  # GUMBEL only: Philox key
    softcap,  # HAS_SOFTCAP only
    seed_ptr,  # GUMBEL and DEVICE_SEED only: int64 [1], the seed read from memory
    GUMBEL: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_S: tl.constexpr,
    DOT_FP32: tl.constexpr,
    LOGIT_DTYPE: tl.constexpr,  # the logits' dtype: the fp32 accumulator is rounded to it first
    RNE_BF16: tl.constexpr,  # interpreter: round to bf16 by bit arithmetic (see _round_to)
    HAS_SOFTCAP: tl.constexpr,
    DEVICE_SEED: tl.constexpr = False,
):
    """out[n] = lowest j with s[n, j] == max_j s[n, j], one program per (row tile, vocab split).

    With HAS_SOFTCAP the fp32 accumulator first becomes ``softcap *
    tanh(acc / softcap)``. logits = round(that) to LOGIT_DTYPE (nearest even, as a bf16/fp16
    GEMM writes its output; no rounding for fp32), then s = logits, or
    logits * inv_temperature - log(-log(U[row * V + j])) with GUMBEL (U = tl.rand keyed by ``seed``),
    or with GUMBEL and DEVICE_SEED logits * inv_temperature + G(seed_ptr[0], row, j)
    (:func:`dflash_kernels.noise.philox_gumbel`, the seed loaded once per program before any store).

    Program ``pid`` has row tile ``pid % n_row_tiles`` (row tiles vary fastest, so the programs reading
    one weight slice run side by side and share it in L2) and split ``pid // n_row_tiles``: the contiguous
    vocab tiles ``[split * tiles_per_split, +tiles_per_split)``. It folds every tile into a running
    per-row (best, id) in registers (strictly greater replaces, so the lower id keeps a tie), writes
    that partial to ``pval / pidx[rows, split]``, and takes a ticket (``atomic_add`` on its row tile's
    counter, acq_rel). The program that draws the last ticket merges the ``n_splits`` partials of its
    rows in split order (max, then the lowest id among the splits reaching it: the lowest vocab id),
    writes ``out`` and resets the counter to 0 for the next launch (a CUDA-graph replay included).
    A split never sees a NaN best (``>`` is false for NaN), so every id is valid.

    Overlap: a program reads ``a``, ``w`` (and ``seed_ptr``) and writes only its own ``(rows, split)``
    entries of ``pval`` / ``pidx``. The barrier then the release half of the ticket's acq_rel orders
    every thread's partial stores before the ticket; the last program's acquire (and the barrier
    Triton puts after a scalar atomic to broadcast its result) orders its reads of all the partials
    after every other ticket, and it reads them through L2 (``.cg``), never a stale L1 line. Only that
    one program per row tile writes ``out[rows]`` and the counter, after every other program of the
    row tile is done with it; launches on one stream never overlap, so the counter is 0 at each start.
    """
    pid_m, split, offs_m, tile0, tile_end = _split_program(N, V, tiles_per_split, BLOCK_M, BLOCK_N)
    m_mask = offs_m < N
    rows64 = offs_m.to(tl.int64)
    if GUMBEL and DEVICE_SEED:
        seed_value = tl.load(seed_ptr)
    run_best = tl.full([BLOCK_M], float("-inf"), tl.float32)
    run_idx = tl.full([BLOCK_M], 0, tl.int32) + tile0 * BLOCK_N
    for tile in range(tile0, tile_end):
        offs_n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        acc = _tile_logits(a_ptr, stride_am, w_ptr, stride_wn, N, V, H, offs_m, offs_n, softcap,
                           BLOCK_M, BLOCK_N, BLOCK_K, DOT_FP32, HAS_SOFTCAP)
        n_mask = offs_n < V
        if LOGIT_DTYPE != tl.float32:
            acc = _round_to(acc, LOGIT_DTYPE, RNE_BF16)
        if GUMBEL:
            if DEVICE_SEED:
                acc = acc * inv_temperature + philox_gumbel(seed_value, offs_m[:, None], offs_n[None, :])
            else:
                # int32 counters: the launcher keeps N * V < 2**31 per launch.
                counter = tl.minimum(offs_m, N - 1)[:, None] * V + offs_n[None, :]
                u = tl.rand(seed, counter)
                acc = acc * inv_temperature - tl.log(-tl.log(u))
        score = tl.where(n_mask[None, :], acc, float("-inf"))
        best = tl.max(score, axis=1)
        idx = tl.min(tl.where((score == best[:, None]) & n_mask[None, :], offs_n[None, :], V), axis=1)
        take = best > run_best
        run_idx = tl.where(take, idx, run_idx)
        run_best = tl.where(take, best, run_best)
    tl.store(pval_ptr + rows64 * n_splits + split, run_best, mask=m_mask)
    tl.store(pidx_ptr + rows64 * n_splits + split, run_idx, mask=m_mask)
    tl.debug_barrier()
    ticket = tl.atomic_add(ticket_ptr + pid_m, 1, sem="acq_rel")
    if ticket == n_splits - 1:
        best = tl.full([BLOCK_M], float("-inf"), tl.float32)
        best_idx = tl.full([BLOCK_M], 0, tl.int32)
        for s0 in range(0, n_splits, BLOCK_S):
            offs_s = s0 + tl.arange(0, BLOCK_S)
            mask = m_mask[:, None] & (offs_s < n_splits)[None, :]
            part = rows64[:, None] * n_splits + offs_s[None, :]
            val = tl.load(pval_ptr + part, mask=mask, other=float("-inf"), cache_modifier=".cg")
            ids = tl.load(pidx_ptr + part, mask=mask, other=0, cache_modifier=".cg")
            chunk_best = tl.max(val, axis=1)
            chunk_idx = tl.min(tl.where((val == chunk_best[:, None]) & mask, ids, V), axis=1)
            take = chunk_best > best
            best_idx = tl.where(take, chunk_idx, best_idx)
            best = tl.where(take, chunk_best, best)
        tl.store(out_ptr + rows64, best_idx.to(tl.int64), mask=m_mask)
        tl.store(ticket_ptr + pid_m, 0)

# the row count and the split plan vary per call
@triton.jit(do_not_specialize=DO_NOT_SPECIALIZE["_topk_kernel"])
def _topk_kernel(
    a_ptr, stride_am,  # a [N, H] (dot dtype)
    w_ptr, stride_wn,  # weight [V, H]
    pkey_ptr,  # int64 [N, n_splits, K_BLOCK]: each split's K_BLOCK largest keys, ascending
    pmax_ptr, psum_ptr,  # fp32 [N, n_splits]: each split's row max and sum(exp(logit - max))
    N, V, H,
    tiles_per_split, n_splits,  # vocab tiles per split (the last one may have fewer), splits
    softcap,  # HAS_SOFTCAP only
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, K_BLOCK: tl.constexpr,
    DOT_FP32: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
):
    """Per (row tile, vocab split): the K_BLOCK largest keys of the split's fp32 logits, and the split's
    logsumexp partial (max, sum of exponentials).

    ``key(x, j) = ord(x) << 32 | (0xFFFFFFFF - j)``, ``ord(x)`` the int32 whose signed order is the fp32
    order of ``x`` (``bits ^ ((bits >> 31) & 0x7FFFFFFF)``): keys order by logit, then by the lower vocab
    id, so every key is distinct and an exact tie keeps the lowest id first. Ids past V get the lowest
    int64 and never rank above a real logit. Each tile's K_BLOCK largest keys (:func:`top_desc`, sorted
    descending) merge into the running ascending K_BLOCK (:func:`merge_top`), both bitonic networks in
    registers; the running (max, sum exp) is rescaled per tile. The grid and the
    split plan are :func:`_argmax_kernel`'s (row tiles vary fastest).

    Overlap: a program reads ``a`` and ``w`` and writes only its own ``(rows, split)`` entries of the
    fresh ``pkey`` / ``pmax`` / ``psum``; nothing is read back in the launch.
    """
    _, split, offs_m, tile0, tile_end = _split_program(N, V, tiles_per_split, BLOCK_M, BLOCK_N)
    m_mask = offs_m < N
    rows64 = offs_m.to(tl.int64)
    lowest: tl.constexpr = -9223372036854775807 - 1
    run = tl.full([BLOCK_M, K_BLOCK], lowest, tl.int64)
    run_max = tl.full([BLOCK_M], float("-inf"), tl.float32)
    run_sum = tl.zeros([BLOCK_M], dtype=tl.float32)
    for tile in range(tile0, tile_end):
        offs_n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        acc = _tile_logits(a_ptr, stride_am, w_ptr, stride_wn, N, V, H, offs_m, offs_n, softcap,
                           BLOCK_M, BLOCK_N, BLOCK_K, DOT_FP32, HAS_SOFTCAP)
        n_mask = offs_n < V
        x = tl.where(n_mask[None, :], acc, float("-inf"))
        # every tile holds a real id, so new_max is finite from the first tile on
        new_max = tl.maximum(run_max, tl.max(x, axis=1))
        run_sum = run_sum * tl.exp(run_max - new_max) + tl.sum(tl.exp(x - new_max[:, None]), axis=1)
        run_max = new_max
        bits = x.to(tl.int32, bitcast=True)
        order = bits ^ ((bits >> 31) & 0x7FFFFFFF)
        key = (order.to(tl.int64) << 32) | (0xFFFFFFFF - offs_n.to(tl.int64))[None, :]
        key = tl.where(n_mask[None, :], key, lowest)
        run = merge_top(run, top_desc(key, K_BLOCK))
    offs_k = tl.arange(0, K_BLOCK)
    tl.store(pkey_ptr + (rows64 * n_splits + split)[:, None] * K_BLOCK + offs_k[None, :], run,
             mask=m_mask[:, None])
    tl.store(pmax_ptr + rows64 * n_splits + split, run_max, mask=m_mask)
    tl.store(psum_ptr + rows64 * n_splits + split, run_sum, mask=m_mask)

# --------------------------------------------------------------------------- launchers


def _operand_a(head: HeadInputs, dot_dtype) -> torch.Tensor:
    """The GEMM's A operand ``[N, H]`` in ``dot_dtype`` (normed, gathered rows)."""
    hidden, norm_weight, eps, positions = head.hidden, head.norm_weight, head.eps, head.positions
    if norm_weight is None and positions is None and hidden.dtype == dot_dtype and hidden.stride(1) == 1:
        return hidden
    if hidden.stride(1) != 1:
        hidden = hidden.contiguous()
    N = hidden.shape[0] if positions is None else positions.numel()
    H = hidden.shape[1]
    a = torch.empty(N, H, dtype=dot_dtype, device=hidden.device)
    if N == 0:
        return a
    cfg = norm_config(H)
    _norm_rows_kernel[(triton.cdiv(N, cfg["BLOCK_R"]),)](
        hidden, hidden.stride(0),
        positions if positions is not None else a,
        norm_weight if norm_weight is not None else a,
        a, N, H, float(eps),
        HAS_POS=positions is not None, HAS_NORM=norm_weight is not None,
        BLOCK_R=cfg["BLOCK_R"], BLOCK_H=cfg["BLOCK_H"], RNE_BF16=triton_interpreting(), num_warps=cfg["num_warps"],
    )
    return a


# Under Triton's CPU interpreter every program costs milliseconds of Python,
# so the launcher widens the vocab tiles there to about 4 per call (at most
# 1024 ids: same kernels and masks, several tiles still); compiled launches use
# gemm_config as is.
_INTERPRETER_VOCAB_TILES = 4
_INTERPRETER_MAX_BLOCK_N = 1024


def _interpreter_block_n(block_n: int, n_vocab: int) -> int:
    """The vocab tile under the interpreter: wide enough for about 4 tiles per call, at most 1024 ids."""
    return max(block_n, min(_INTERPRETER_MAX_BLOCK_N, next_power_of_2(-(-n_vocab // _INTERPRETER_VOCAB_TILES))))


def _gemm_launch_args(n_rows: int, n_vocab: int, dot_dtype: torch.dtype):
    cfg = dict(gemm_config(n_rows, dot_dtype))
    if triton_interpreting():
        cfg["BLOCK_N"] = _interpreter_block_n(cfg["BLOCK_N"], n_vocab)
    meta = dict(BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"], GROUP_M=cfg["GROUP_M"],
                DOT_FP32=_dot_fp32(dot_dtype), num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    if gemm_maxnreg(dot_dtype) is not None:
        meta["maxnreg"] = gemm_maxnreg(dot_dtype)
    return cfg, meta


def _logits_chunk(a: torch.Tensor, weight: torch.Tensor, out: torch.Tensor, v0: int, v_end: int,
                  dot_dtype: torch.dtype, softcap: Optional[float] = None) -> torch.Tensor:
    """Write logits[:, v0:v_end] of ``a`` into ``out`` ([N, v_end - v0] fp32, unit last stride), soft-capped
    with ``softcap``.

    Returns the rows' logsumexp over ``v0:v_end`` (fp32 [N]), from per-tile
    partials the kernel writes alongside (``2 * N * n_tiles`` floats).
    """
    N, H = a.shape
    cfg, meta = _gemm_launch_args(N, v_end - v0, dot_dtype)
    n_tiles = triton.cdiv(v_end - v0, cfg["BLOCK_N"])
    pmax = torch.empty(N, n_tiles, dtype=torch.float32, device=a.device)
    psum = torch.empty(N, n_tiles, dtype=torch.float32, device=a.device)
    grid = (triton.cdiv(N, cfg["BLOCK_M"]) * n_tiles,)
    _logits_kernel[grid](
        a, a.stride(0), weight, weight.stride(0), out, out.stride(0), pmax, psum, pmax.stride(0),
        N, v0, v_end, H, 1.0 if softcap is None else float(softcap), HAS_SOFTCAP=softcap is not None, **meta,
    )
    return _combine_lse(pmax, psum)


def _combine_lse(pmax: torch.Tensor, psum: torch.Tensor) -> torch.Tensor:
    """logsumexp from per-tile (max, sum exp(x - max)) partials, [N, tiles] -> [N]."""
    top = pmax.max(dim=1).values
    return top + torch.log((psum * torch.exp(pmax - top[:, None])).sum(dim=1))


_TL_DTYPE = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def _tl_dtype(dtype: torch.dtype):
    """The ``tl`` dtype matching a torch float dtype (a LOGIT_DTYPE constexpr)."""
    return getattr(tl, _TL_DTYPE[dtype])


def _argmax_launch(a: torch.Tensor, weight: torch.Tensor, dot_dtype: torch.dtype, out: torch.Tensor, *,
                   gumbel: bool, logit_dtype: torch.dtype, inv_temperature: float = 1.0, seed: int = 0,
                   softcap: Optional[float] = None, seed_tensor: Optional[torch.Tensor] = None) -> torch.Tensor:
    """One :func:`_argmax_kernel` launch writing the int64 ids of ``a``'s rows into ``out [N]``."""
    N, H = a.shape
    V = weight.shape[0]
    cfg = head_config(N, dot_dtype, gumbel)
    if triton_interpreting():
        cfg["BLOCK_N"] = _interpreter_block_n(cfg["BLOCK_N"], V)
    row_tiles = triton.cdiv(N, cfg["BLOCK_M"])
    tiles_per_split, n_splits = vocab_split_plan(row_tiles, triton.cdiv(V, cfg["BLOCK_N"]), _head_programs(a.device))
    pval = torch.empty(N, n_splits, dtype=torch.float32, device=a.device)
    pidx = torch.empty(N, n_splits, dtype=torch.int32, device=a.device)
    device_seed = seed_tensor is not None
    if device_seed:
        seed = _SEED_MOD  # (unused: the seed is read from seed_tensor; an int64 stand-in keeps one signature)
    seed_ptr = seed_tensor.reshape(1) if device_seed else _seed_placeholder(a.device)
    meta = {k: cfg[k] for k in ("BLOCK_M", "BLOCK_N", "BLOCK_K", "BLOCK_S", "num_warps", "num_stages")}
    if cfg["maxnreg"] is not None:
        meta["maxnreg"] = cfg["maxnreg"]
    _argmax_kernel[(row_tiles * n_splits,)](
        a, a.stride(0), weight, weight.stride(0), pval, pidx, _tickets(a.device, row_tiles), out, N, V, H,
        tiles_per_split, n_splits, float(inv_temperature), seed, 1.0 if softcap is None else float(softcap),
        seed_ptr, GUMBEL=gumbel, DOT_FP32=_dot_fp32(dot_dtype), LOGIT_DTYPE=_tl_dtype(logit_dtype),
        RNE_BF16=triton_interpreting(), HAS_SOFTCAP=softcap is not None, DEVICE_SEED=device_seed, **meta,
    )
    return out


#: Row tiles of the heads' kernel at most (the ticket buffer's length; grown on demand).
_TICKETS_MIN = 1024
_tickets_by_device: Dict[torch.device, torch.Tensor] = {}


def _tickets(device: torch.device, row_tiles: int) -> torch.Tensor:
    """The device's zeroed int32 ticket counters of :func:`_argmax_kernel`, one per row tile.

    Allocated once (zeros) and left at zero by every launch (the last program of a row tile resets its
    counter), so no launch clears it and a CUDA-graph replay finds it zeroed. Launches sharing it must be
    stream-ordered (one stream per device, as every caller here). A buffer outgrown by a longer call is
    kept alive, never freed: a CUDA graph captured earlier still replays its atomics on that address.
    """
    buf = _tickets_by_device.get(device)
    if buf is None or buf.numel() < row_tiles:
        if buf is not None:
            _outgrown_tickets.append(buf)
        buf = torch.zeros(max(_TICKETS_MIN, row_tiles), dtype=torch.int32, device=device)
        _tickets_by_device[device] = buf
    return buf


#: ticket buffers replaced by longer ones, held so that no captured graph's counters are ever freed
_outgrown_tickets: List[torch.Tensor] = []


_seed_placeholders: Dict[torch.device, torch.Tensor] = {}


def _seed_placeholder(device: torch.device) -> torch.Tensor:
    """An int64 ``[1]`` passed as ``seed_ptr`` when the kernel variant does not read it."""
    if device not in _seed_placeholders:
        _seed_placeholders[device] = torch.zeros(1, dtype=torch.int64, device=device)
    return _seed_placeholders[device]


def _kernel_seed(seed: int, chunk: int) -> int:
    """Philox key for row chunk ``chunk``: always in [2**61, 2**62) so Triton passes it as int64."""
    return ((seed + chunk * 0x9E3779B97F4A7C15) % _SEED_MOD) | _SEED_MOD


def _sample_rows_per_launch(vocab: int) -> int:
    return max(1, _INT32_MAX // vocab)


def _prepare(head: HeadInputs):
    """``(a [N, H], weight [V, H] unit last stride, dot dtype)`` of a launch."""
    dot_dtype = dot_dtype_for(head.hidden.dtype, head.weight.dtype)
    weight = head.weight if head.weight.stride(1) == 1 else head.weight.contiguous()
    return _operand_a(head, dot_dtype), weight, dot_dtype


def _logits_triton(head: HeadInputs, logit_dtype=torch.float32):
    a, weight, dot_dtype = _prepare(head)
    N, V = a.shape[0], weight.shape[0]
    out = torch.empty(N, V, dtype=torch.float32, device=a.device)
    if N > 0:
        _logits_chunk(a, weight, out, 0, V, dot_dtype, head.softcap)
    return out if logit_dtype == torch.float32 else out.to(logit_dtype)  # torch's cast rounds to nearest even


def _argmax_triton(head: HeadInputs, logit_dtype):
    a, weight, dot_dtype = _prepare(head)
    out = torch.empty(a.shape[0], dtype=torch.int64, device=a.device)
    if a.shape[0] == 0:
        return out
    return _argmax_launch(a, weight, dot_dtype, out, gumbel=False, logit_dtype=logit_dtype, softcap=head.softcap)


def _sample_triton(head: HeadInputs, temperature, seed: int, logit_dtype):
    a, weight, dot_dtype = _prepare(head)
    N, V = a.shape[0], weight.shape[0]
    out = torch.empty(N, dtype=torch.int64, device=a.device)
    step = _sample_rows_per_launch(V)
    for chunk, r0 in enumerate(range(0, N, step)):
        _argmax_launch(a[r0:r0 + step], weight, dot_dtype, out[r0:r0 + step], gumbel=True,
                       logit_dtype=logit_dtype, inv_temperature=1.0 / temperature,
                       seed=_kernel_seed(seed, chunk), softcap=head.softcap)
    return out


def _sample_device_seed_triton(head: HeadInputs, temperature, seed: torch.Tensor, logit_dtype):
    """One launch over every row: the noise is keyed by (seed, row, vocab id), with no int32 counter bound."""
    a, weight, dot_dtype = _prepare(head)
    out = torch.empty(a.shape[0], dtype=torch.int64, device=a.device)
    if a.shape[0] == 0:
        return out
    return _argmax_launch(a, weight, dot_dtype, out, gumbel=True, logit_dtype=logit_dtype,
                          inv_temperature=1.0 / temperature, softcap=head.softcap, seed_tensor=seed)


def topk_chunk_plan(n_rows: int, vocab: int, chunk_elements: Optional[int] = None) -> Tuple[int, int]:
    """(rows per chunk, vocab ids per chunk) of the top-K loop: rows * vocab_chunk <= chunk_elements."""
    budget = max(1, int(chunk_elements or DEFAULT_CHUNK_ELEMENTS))
    if n_rows * vocab <= budget:
        return max(n_rows, 1), vocab
    vocab_chunk = min(vocab, max(256, (budget // max(n_rows, 1)) // 256 * 256))
    rows = max(1, min(n_rows, budget // vocab_chunk))
    return rows, vocab_chunk


def _topk_chunked(head: HeadInputs, k, chunk_elements):
    """Top-k log-probs for a k too wide for registers: fp32 logits in chunks of at most ``chunk_elements``,
    each chunk's ``torch.topk`` merged into a running one, and a running logsumexp."""
    a, weight, dot_dtype = _prepare(head)
    N, V = a.shape[0], weight.shape[0]
    values = torch.empty(N, k, dtype=torch.float32, device=a.device)
    ids = torch.empty(N, k, dtype=torch.int64, device=a.device)
    if N == 0:
        return values, ids
    rows_per, vocab_per = topk_chunk_plan(N, V, chunk_elements)
    buf = torch.empty(min(rows_per, N), vocab_per, dtype=torch.float32, device=a.device)
    for r0 in range(0, N, rows_per):
        a_rows = a[r0:r0 + rows_per]
        nr = a_rows.shape[0]
        best_vals = best_ids = lse = None
        for v0 in range(0, V, vocab_per):
            v_end = min(V, v0 + vocab_per)
            chunk = buf[:nr, :v_end - v0]
            chunk_lse = _logits_chunk(a_rows, weight, chunk, v0, v_end, dot_dtype, head.softcap)
            lse = chunk_lse if lse is None else torch.logaddexp(lse, chunk_lse)
            c_vals, c_ids = torch.topk(chunk, min(k, v_end - v0), dim=1)
            c_ids += v0
            if best_vals is None:
                best_vals, best_ids = c_vals, c_ids
            else:
                merged_vals = torch.cat([best_vals, c_vals], dim=1)
                merged_ids = torch.cat([best_ids, c_ids], dim=1)
                best_vals, pick = torch.topk(merged_vals, min(k, merged_vals.shape[1]), dim=1)
                best_ids = merged_ids.gather(1, pick)
        values[r0:r0 + nr] = best_vals - lse[:, None]
        ids[r0:r0 + nr] = best_ids
    return values, ids


def _topk_triton(head: HeadInputs, k, chunk_elements):
    """Top-k log-probs: the fused kernel up to :func:`topk_fused_max` keys per row, the chunked path above."""
    if next_power_of_2(k) > topk_fused_max(dot_dtype_for(head.hidden.dtype, head.weight.dtype)):
        return _topk_chunked(head, k, chunk_elements)
    return _topk_fused(head, k)


def _decode_keys(keys: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """(fp32 logits, int64 ids) of :func:`_topk_kernel`'s int64 keys (the inverse of its key map)."""
    order = keys >> 32
    bits = (order ^ ((order >> 31) & 0x7FFFFFFF)).to(torch.int32)
    return bits.view(torch.float32), 0xFFFFFFFF - (keys & 0xFFFFFFFF)


def _topk_fused(head: HeadInputs, k):
    """:func:`_topk_kernel` over (row tiles x vocab splits), then the k largest of the ``n_splits * K_BLOCK``
    keys per row (one ``torch.topk`` of int64 ``[N, n_splits * K_BLOCK]``, best first), decoded to (logit,
    id), minus the logsumexp of the splits' (max, sum exp) partials. No ``[N, V]`` logits are written."""
    a, weight, dot_dtype = _prepare(head)
    N, V = a.shape[0], weight.shape[0]
    if N == 0:
        return (torch.empty(0, k, dtype=torch.float32, device=a.device),
                torch.empty(0, k, dtype=torch.int64, device=a.device))
    cfg = topk_config(N, dot_dtype, k, device_arch(a.device))
    if triton_interpreting():
        cfg["BLOCK_N"] = _interpreter_block_n(cfg["BLOCK_N"], V)
    row_tiles = triton.cdiv(N, cfg["BLOCK_M"])
    tiles_per_split, n_splits = vocab_split_plan(row_tiles, triton.cdiv(V, cfg["BLOCK_N"]), _head_programs(a.device))
    pkey = torch.empty(N, n_splits * cfg["K_BLOCK"], dtype=torch.int64, device=a.device)
    pmax = torch.empty(N, n_splits, dtype=torch.float32, device=a.device)
    psum = torch.empty(N, n_splits, dtype=torch.float32, device=a.device)
    meta = {key: cfg[key] for key in ("BLOCK_M", "BLOCK_N", "BLOCK_K", "K_BLOCK", "num_warps", "num_stages")}
    if cfg["maxnreg"] is not None:
        meta["maxnreg"] = cfg["maxnreg"]
    _topk_kernel[(row_tiles * n_splits,)](
        a, a.stride(0), weight, weight.stride(0), pkey, pmax, psum, N, V, a.shape[1], tiles_per_split, n_splits,
        1.0 if head.softcap is None else float(head.softcap), DOT_FP32=_dot_fp32(dot_dtype),
        HAS_SOFTCAP=head.softcap is not None, **meta,
    )
    logits, ids = _decode_keys(pkey.topk(k, dim=1).values)
    return logits - _combine_lse(pmax, psum)[:, None], ids


# --------------------------------------------------------------------------- public ops


def lm_head_logits(hidden, weight, *, norm_weight=None, eps=1e-6, positions=None, check_bounds=True,
                   logit_dtype=torch.float32, softcap=None, backend=None) -> torch.Tensor:
    """``[N, V]`` logits of ``rms_norm(hidden[positions]) @ weight.T`` (the full output, by request).

    Accumulated in fp32; returned as fp32 by default, or rounded (nearest
    even) to ``logit_dtype`` (None: the dtype ``F.linear`` returns, i.e. the
    promotion of hidden's and the weight's dtypes; see :func:`lm_head_argmax`).
    ``softcap``: None, or a finite float ``c > 0``, the final-logit softcap
    (Gemma 2 / 3's ``final_logit_softcapping``): logits become ``c * tanh(logits / c)``
    on the fp32 accumulator, before the rounding.

    ``backend``: 'triton' or 'reference' to fix the backend (a compiled round
    does), None: :func:`dflash_kernels.get_backend`.
    """
    head = head_inputs(hidden, weight, norm_weight, eps, positions, softcap, check_bounds=check_bounds)
    logit_dtype = resolve_logit_dtype(hidden, weight, logit_dtype)
    return dispatch(
        backend, hidden.device,
        reference=lambda: _reference.lm_head_logits(hidden, weight, norm_weight=norm_weight, eps=eps,
                                                    positions=head.positions, check_bounds=False,
                                                    logit_dtype=logit_dtype, softcap=head.softcap),
        traced=lambda: torch.ops.dflash.lm_head_logits(hidden, weight, norm_weight, head.positions, eps, False,
                                                       logit_dtype, head.softcap),
        triton=lambda: _logits_triton(head.detached(), logit_dtype))


def _rows(a) -> int:
    """Selected row count ``N`` in a shape rule (``a``: the op's arguments by name): ``a.positions``' length, else
    every row of ``a.hidden``."""
    return a.hidden.shape[0] if a.positions is None else a.positions.shape[0]


def _token_rows(a) -> Tensor:
    """The shape rule of a head op that picks one token per selected row: int64 ``[N]``."""
    return a.hidden.new_empty(_rows(a), dtype=torch.int64)


@declare("lm_head_logits", fake=lambda a: a.hidden.new_empty(
    _rows(a), a.weight.shape[0], dtype=resolve_logit_dtype(a.hidden, a.weight, a.logit_dtype)))
def _lm_head_logits_op(hidden: Tensor, weight: Tensor, norm_weight: Optional[Tensor] = None,
                       positions: Optional[Tensor] = None, eps: float = 1e-6, check_bounds: bool = True,
                       logit_dtype: Optional[torch.dtype] = torch.float32, softcap: Optional[float] = None) -> Tensor:
    """:func:`lm_head_logits`: ``[N, V]`` logits in ``logit_dtype`` (None: F.linear's dtype)."""
    return lm_head_logits(hidden, weight, norm_weight=norm_weight, eps=eps, positions=positions,
                          check_bounds=check_bounds, logit_dtype=logit_dtype, softcap=softcap)


def lm_head_argmax(hidden, weight, *, norm_weight=None, eps=1e-6, positions=None, check_bounds=True,
                   logit_dtype=None, softcap=None, backend=None) -> torch.Tensor:
    """int64 ``[N]`` greedy tokens: ``argmax`` of the logits, lowest id on ties. No logits are stored.

    ``logit_dtype``: the dtype the logits are compared in, as Hugging Face's
    ``generate()`` takes the argmax of the lm_head output in the model's
    dtype. None (default): the dtype ``F.linear`` would return here (the
    promotion of hidden's dtype, which the norm keeps, and the weight's: bf16
    for a bf16 model); the kernel rounds the fp32 accumulator to it (nearest
    even, as a bf16/fp16 GEMM writes its output) before the argmax, so logits
    that tie in that dtype pick the lowest id. ``torch.float32``: the argmax
    of the fp32-accumulated logits (no rounding).
    ``softcap``: None, or a finite float ``c > 0``, the final-logit softcap
    (Gemma 2 / 3's ``final_logit_softcapping``): logits become ``c * tanh(logits / c)``
    on the fp32 accumulator, before the rounding (so capped logits that tie once rounded pick the
    lowest id). ``check_bounds=False`` reads no tensor value on the host (no sync).

    ``backend``: 'triton' or 'reference' to fix the backend (a compiled round
    does), None: :func:`dflash_kernels.get_backend`.
    """
    head = head_inputs(hidden, weight, norm_weight, eps, positions, softcap, check_bounds=check_bounds)
    logit_dtype = resolve_logit_dtype(hidden, weight, logit_dtype)
    return dispatch(
        backend, hidden.device,
        reference=lambda: _reference.lm_head_argmax(hidden, weight, norm_weight=norm_weight, eps=eps,
                                                    positions=head.positions, check_bounds=False,
                                                    logit_dtype=logit_dtype, softcap=head.softcap),
        traced=lambda: torch.ops.dflash.lm_head_argmax(hidden, weight, norm_weight, head.positions, eps, False,
                                                       logit_dtype, head.softcap),
        triton=lambda: _argmax_triton(head.detached(), logit_dtype))


@declare("lm_head_argmax", fake=_token_rows)
def _lm_head_argmax_op(hidden: Tensor, weight: Tensor, norm_weight: Optional[Tensor] = None,
                       positions: Optional[Tensor] = None, eps: float = 1e-6, check_bounds: bool = True,
                       logit_dtype: Optional[torch.dtype] = None, softcap: Optional[float] = None) -> Tensor:
    """:func:`lm_head_argmax`: int64 ``[N]`` greedy tokens."""
    return lm_head_argmax(hidden, weight, norm_weight=norm_weight, eps=eps, positions=positions,
                          check_bounds=check_bounds, logit_dtype=logit_dtype, softcap=softcap)


def lm_head_topk(hidden, weight, k, *, norm_weight=None, eps=1e-6, positions=None, check_bounds=True,
                 chunk_elements: Optional[int] = None, softcap=None,
                 backend=None) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(logprobs fp32 [N, k], ids int64 [N, k])``: top-k of the full-vocab log-softmax, best first.

    ``chunk_elements`` bounds the fp32 logits held at once (default
    :data:`DEFAULT_CHUNK_ELEMENTS`); ``k > V`` is an error.
    ``softcap``: None, or a finite float ``c > 0``, the final-logit softcap
    (Gemma 2 / 3's ``final_logit_softcapping``): logits become ``c * tanh(logits / c)``
    on the fp32 accumulator, before the log-softmax.

    ``backend``: 'triton' or 'reference' to fix the backend (a compiled round
    does), None: :func:`dflash_kernels.get_backend`.
    """
    head = head_inputs(hidden, weight, norm_weight, eps, positions, softcap, check_bounds=check_bounds)
    check_k(k, weight.shape[0])
    return dispatch(
        backend, hidden.device,
        reference=lambda: _reference.lm_head_topk(hidden, weight, k, norm_weight=norm_weight, eps=eps,
                                                  positions=head.positions, check_bounds=False, softcap=head.softcap),
        traced=lambda: torch.ops.dflash.lm_head_topk(hidden, weight, k, norm_weight, head.positions, eps, False,
                                                     chunk_elements, head.softcap),
        triton=lambda: _topk_triton(head.detached(), k, chunk_elements))


@declare("lm_head_topk", fake=lambda a: (a.hidden.new_empty(_rows(a), a.k, dtype=torch.float32),
                                         a.hidden.new_empty(_rows(a), a.k, dtype=torch.int64)))
def _lm_head_topk_op(hidden: Tensor, weight: Tensor, k: int, norm_weight: Optional[Tensor] = None,
                     positions: Optional[Tensor] = None, eps: float = 1e-6, check_bounds: bool = True,
                     chunk_elements: Optional[int] = None, softcap: Optional[float] = None) -> Tuple[Tensor, Tensor]:
    """:func:`lm_head_topk`: ``(logprobs fp32 [N, k], ids int64 [N, k])``."""
    return lm_head_topk(hidden, weight, k, norm_weight=norm_weight, eps=eps, positions=positions,
                        check_bounds=check_bounds, chunk_elements=chunk_elements, softcap=softcap)


def sample_gumbel(hidden, weight, temperature, *, norm_weight=None, eps=1e-6, positions=None, generator=None,
                  seed=None, check_bounds=True, logit_dtype=None, softcap=None, backend=None) -> torch.Tensor:
    """:func:`dflash_kernels.lm_head_sample` without filters: int64 ``[N]``, one token per row drawn from
    ``softmax(logits / temperature)``, fused into the lm_head GEMM.

    ``logits`` are rounded to ``logit_dtype`` first (default None: the dtype
    ``F.linear`` returns, as in :func:`lm_head_argmax`; transformers samples
    from those rounded logits), then scaled by the temperature.
    ``softcap``: None, or a finite float ``c > 0``, the final-logit softcap
    (Gemma 2 / 3's ``final_logit_softcapping``): logits become ``c * tanh(logits / c)``
    on the fp32 accumulator, before the rounding: the draw is from
    ``softmax(round(c * tanh(logits / c)) / temperature)``.

    ``temperature > 0`` (use :func:`lm_head_argmax` for greedy). Reproducible:
    the Triton path draws one 62-bit seed from ``generator`` (or takes
    ``seed``; neither: torch's default generator) and generates Gumbel noise
    in-kernel from it, so equal seeds give equal samples. The reference path
    uses ``torch.multinomial`` with the same generator/seed (same
    distribution, different draws).

    ``seed`` an int64 (int32) tensor ``[1]`` / ``[]`` on hidden's device (a
    compiled / CUDA-graph step): read in-kernel, never on the host:
    ``token[n] = argmax_j(logits[n, j] * inv_t + G(seed, n, j))``, ``inv_t`` =
    fp32 ``1 / T``, ``G`` the counter-based Gumbel noise of
    :func:`dflash_kernels.reference.gumbel_noise` (Philox-4x32 of (vocab id,
    output row), keyed by the seed's value), one launch for every row. A CUDA
    graph of the call replays new noise when the caller changes the seed
    tensor; equal values give equal samples, the same noise on both backends.
    Pass ``check_bounds=False`` there (the positions' range check reads them on
    the host).

    ``backend``: 'triton' or 'reference' to fix the backend (a compiled round
    does), None: :func:`dflash_kernels.get_backend`.
    """
    if generator is not None and seed is not None:
        raise ValueError("pass either generator or seed to lm_head_sample, not both")
    device_seed = isinstance(seed, torch.Tensor)
    head = head_inputs(hidden, weight, norm_weight, eps, positions, softcap, check_bounds=check_bounds)
    t = check_temperature(temperature)
    logit_dtype = resolve_logit_dtype(hidden, weight, logit_dtype)
    if device_seed:
        seed = check_seed_tensor(seed, hidden.device)

    def traced():
        if not device_seed:
            raise TypeError("lm_head_sample under torch.compile takes seed as an int64 tensor [1] on hidden's "
                            f"device (a generator or an int seed draws on the host), got {type(seed).__name__}")
        return torch.ops.dflash.lm_head_sample.tensor(hidden, weight, t, seed, norm_weight, head.positions, eps,
                                                      logit_dtype, head.softcap)

    def triton_path():
        if device_seed:
            return _sample_device_seed_triton(head.detached(), t, seed, logit_dtype)
        return _sample_triton(head.detached(), t, seed_from(generator, seed), logit_dtype)

    return dispatch(
        backend, hidden.device, traced=traced, triton=triton_path,
        reference=lambda: _reference.lm_head_sample(hidden, weight, t, norm_weight=norm_weight, eps=eps,
                                                    positions=head.positions, generator=generator, seed=seed,
                                                    check_bounds=False, logit_dtype=logit_dtype,
                                                    softcap=head.softcap))


@declare("lm_head_sample", fake=_token_rows)
def _lm_head_sample_op(hidden: Tensor, weight: Tensor, temperature: float, seed: int,
                       norm_weight: Optional[Tensor] = None, positions: Optional[Tensor] = None, eps: float = 1e-6,
                       check_bounds: bool = True, logit_dtype: Optional[torch.dtype] = None,
                       softcap: Optional[float] = None) -> Tensor:
    """:func:`dflash_kernels.lm_head_sample` (no filter) with ``seed=seed``: int64 ``[N]`` draws, equal for equal
    seeds (a schema has no ``torch.Generator``; the seed is a required int, so the op is deterministic)."""
    return sample_gumbel(hidden, weight, temperature, norm_weight=norm_weight, eps=eps, positions=positions,
                         seed=seed, check_bounds=check_bounds, logit_dtype=logit_dtype, softcap=softcap)


@declare("lm_head_sample.tensor", fake=_token_rows)
def _lm_head_sample_tensor_op(hidden: Tensor, weight: Tensor, temperature: float, seed: Tensor,
                              norm_weight: Optional[Tensor] = None, positions: Optional[Tensor] = None,
                              eps: float = 1e-6, logit_dtype: Optional[torch.dtype] = None,
                              softcap: Optional[float] = None) -> Tensor:
    """:func:`dflash_kernels.lm_head_sample` (no filter) with ``seed=`` a device tensor (int64 ``[1]``, read
    in-kernel): int64 ``[N]`` draws; ``positions`` are not range-checked (no host read)."""
    return sample_gumbel(hidden, weight, temperature, norm_weight=norm_weight, eps=eps, positions=positions,
                         seed=seed, check_bounds=False, logit_dtype=logit_dtype, softcap=softcap)


# --------------------------------------------------------------------------- compile enumeration

_TRITON_TYPE = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}

#: (hidden size H, vocabulary size V) of real targets: Qwen3-4B, Qwen3-8B,
#: Llama-3.1-8B. (The CPU-sized tiny pair, (128, 258), has V not a multiple of
#: 16: pass ``shapes=`` to enumerate its binaries too.)
REAL_SHAPES = ((2560, 151936), (4096, 151936), (4096, 128256))
REAL_HIDDEN_SIZES = tuple(sorted({h for h, _ in REAL_SHAPES}))
REAL_VOCAB_SIZES = tuple(sorted({v for _, v in REAL_SHAPES}))
REAL_POSITION_COUNTS = (1, 7, 15, 16, 17, 64, 65, 257, 1024, 8192)
REAL_DTYPES = ((torch.bfloat16, torch.bfloat16), (torch.float16, torch.float16), (torch.float32, torch.float32))


class LaunchConfigs:
    """The distinct compiled variants of a module's kernels, as :func:`launch_configs` lists them: :meth:`add`
    one launch (pointer types, integer argument values at a shape, constexprs), deduplicated into :attr:`out`.
    The integer arguments get the runtime's specialization (``gather.runtime_int_specialization``) except the
    kernel's ``do_not_specialize`` ones (``do_not_specialize``: the module's table, kernel name -> names)."""

    def __init__(self, do_not_specialize: Dict[str, Tuple[str, ...]]):
        self.do_not_specialize = do_not_specialize
        self.out: List[dict] = []
        self._seen = set()

    def add(self, name, kernel, pointers, ints, constexprs, num_warps, num_stages, tensor_core_dot=False,
            maxnreg=None) -> None:
        from .gather import runtime_int_specialization

        dns = self.do_not_specialize.get(kernel.__name__, ())
        types, divisible, ones = runtime_int_specialization(ints, dns)
        signature = dict(pointers, **types)
        constexprs = dict(constexprs, **ones)
        key = (kernel.__name__, tuple(sorted(signature.items())), tuple(sorted(constexprs.items(), key=str)),
               tuple(sorted(divisible)), num_warps, num_stages)
        if key in self._seen:
            return
        self._seen.add(key)
        tag = ",".join(sorted(divisible)) or "none"
        self.out.append(dict(name=f"{name} div16={tag}", kernel=kernel, signature=signature, constexprs=constexprs,
                             num_warps=num_warps, num_stages=num_stages, tensor_core_dot=tensor_core_dot,
                             divisible_by_16=sorted(divisible), do_not_specialize=list(dns), maxnreg=maxnreg))


def launch_configs(shapes=REAL_SHAPES, position_counts=REAL_POSITION_COUNTS, dtypes=REAL_DTYPES,
                   arch: int = DEFAULT_ARCH) -> List[dict]:
    """Every distinct compiled variant the launchers pick for the given shapes (compiled GPU mode) on GPU
    architecture ``arch`` (only the fused top-K's tiles depend on it).

    ``shapes`` holds ``(H, V)`` pairs; ``dtypes`` holds ``(hidden dtype,
    weight dtype)`` pairs (real models use matching ones; pass e.g.
    ``(float32, bfloat16)`` to cover the mixed fp32 path too). Each entry:
    ``name``, ``kernel``, ``signature`` (Triton type strings by arg name),
    ``constexprs``, ``num_warps``, ``num_stages``, ``divisible_by_16``,
    ``do_not_specialize`` and ``tensor_core_dot`` (True when the GEMM runs a
    bf16/fp16 ``tl.dot``). Built from the same config functions the launchers
    call, and from the integer arguments' values at that shape as the Triton
    runtime specializes them (``gather.runtime_int_specialization``): the
    strides ``H`` / ``V``, ``H`` and ``V`` get ``divisible_by_16`` when they
    are multiples of 16 (an argument equal to 1 would become a constexpr);
    row counts, vocab chunk bounds and row offsets are
    :data:`DO_NOT_SPECIALIZE` (their values here are stand-ins). Argmax /
    sample are listed for both logit dtypes a launcher passes: the model's
    (the default) and fp32. The final-logit softcap variants (``HAS_SOFTCAP``)
    are listed for the logits kernel at every tile, and for
    the heaviest argmax epilogue only (Gumbel sampling in the model's logit
    dtype: the greedy one is the same code minus the noise). The device-seed
    sampling epilogue (``DEVICE_SEED``: the seed loaded from memory, Philox of
    (vocab id, row)) is listed with and without the cap, and the
    :func:`gumbel_noise_block` kernel once per distinct row stride.
    """
    collect = LaunchConfigs(DO_NOT_SPECIALIZE)

    def add(name, kernel, pointers, ints, constexprs, num_warps, num_stages, tensor_core_dot=False, maxnreg=None):
        if kernel is _logits_kernel:
            maxnreg = gemm_maxnreg(torch.float32 if constexprs.get("DOT_FP32") else torch.bfloat16)
        collect.add(name, kernel, pointers, ints, constexprs, num_warps, num_stages, tensor_core_dot, maxnreg)

    for hidden_dtype, weight_dtype in dtypes:
        dot = dot_dtype_for(hidden_dtype, weight_dtype)
        ht, wt, dt = _TRITON_TYPE[hidden_dtype], _TRITON_TYPE[weight_dtype], _TRITON_TYPE[dot]
        default_logit = torch.promote_types(hidden_dtype, weight_dtype)
        logit_dtypes = [default_logit] + ([torch.float32] if default_logit != torch.float32 else [])
        for H, V in shapes:
            ncfg = norm_config(H)
            for has_pos in (False, True):
                for has_norm in (False, True):
                    add(f"norm_rows[{ht}->{dt} pos={has_pos} norm={has_norm} R{ncfg['BLOCK_R']}xH{ncfg['BLOCK_H']}]",
                        _norm_rows_kernel,
                        {"x_ptr": "*" + ht, "pos_ptr": "*i64", "nw_ptr": "*" + ht, "out_ptr": "*" + dt,
                         "eps": "fp32"},
                        {"stride_x": H, "N": 16, "H": H},
                        {"HAS_POS": has_pos, "HAS_NORM": has_norm, "BLOCK_R": ncfg["BLOCK_R"],
                         "BLOCK_H": ncfg["BLOCK_H"], "RNE_BF16": False},
                        ncfg["num_warps"], 1)
            for n in position_counts:
                cfg = gemm_config(n, dot)
                common = {k: cfg[k] for k in ("BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M")}
                common["DOT_FP32"] = dot == torch.float32
                tag = f"{dt}/{wt} M{cfg['BLOCK_M']}N{cfg['BLOCK_N']}K{cfg['BLOCK_K']}"
                tc = dot != torch.float32
                n_tiles = triton.cdiv(V, cfg["BLOCK_N"])
                for softcap in (False, True):
                    add(f"logits[{tag}{' softcap' if softcap else ''}]", _logits_kernel,
                        {"a_ptr": "*" + dt, "w_ptr": "*" + wt, "out_ptr": "*fp32", "pmax_ptr": "*fp32",
                         "psum_ptr": "*fp32", "softcap": "fp32"},
                        {"stride_am": H, "stride_wn": H, "stride_om": V, "stride_pm": n_tiles, "N": n, "V0": 0,
                         "V_END": V, "H": H},
                        dict(common, HAS_SOFTCAP=softcap), cfg["num_warps"], cfg["num_stages"], tc)
                # (logit dtype, gumbel, softcap, device seed): every epilogue without the cap, the heaviest
                # one with it; the device-seed Gumbel epilogue (Philox of (vocab id, row)) with and without it
                variants = [(ld, g, False, False) for ld in logit_dtypes for g in (False, True)]
                variants.append((default_logit, True, True, False))
                variants += [(default_logit, True, False, True), (default_logit, True, True, True)]
                for logit_dtype, gumbel, softcap, device_seed in variants:
                    hcfg = head_config(n, dot, gumbel)
                    htag = f"{dt}/{wt} M{hcfg['BLOCK_M']}N{hcfg['BLOCK_N']}K{hcfg['BLOCK_K']}"
                    tiles_per_split, n_splits = vocab_split_plan(triton.cdiv(n, hcfg["BLOCK_M"]),
                                                                 triton.cdiv(V, hcfg["BLOCK_N"]), 264)
                    add(f"argmax[{htag} gumbel={gumbel} logits={_TRITON_TYPE[logit_dtype]}"
                        f"{' softcap' if softcap else ''}{' device_seed' if device_seed else ''}]", _argmax_kernel,
                        {"a_ptr": "*" + dt, "w_ptr": "*" + wt, "pval_ptr": "*fp32", "pidx_ptr": "*i32",
                         "ticket_ptr": "*i32", "out_ptr": "*i64", "inv_temperature": "fp32", "softcap": "fp32",
                         "seed_ptr": "*i64"},
                        {"stride_am": H, "stride_wn": H, "N": n, "V": V, "H": H, "tiles_per_split": tiles_per_split,
                         "n_splits": n_splits, "seed": _SEED_MOD},
                        {k: hcfg[k] for k in ("BLOCK_M", "BLOCK_N", "BLOCK_K", "BLOCK_S")}
                        | dict(DOT_FP32=dot == torch.float32, GUMBEL=gumbel, LOGIT_DTYPE=_tl_dtype(logit_dtype),
                               RNE_BF16=False, HAS_SOFTCAP=softcap, DEVICE_SEED=device_seed),
                        hcfg["num_warps"], hcfg["num_stages"], tc, hcfg["maxnreg"])
                # the fused top-K at each real width, uncapped and (at DDTree's width) capped
                for k in (k for k in REAL_TOPK if k <= topk_fused_max(dot)):
                    for softcap in ((False, True) if k == 64 else (False,)):
                        tcfg = topk_config(n, dot, k, arch)
                        ttag = f"{dt}/{wt} M{tcfg['BLOCK_M']}N{tcfg['BLOCK_N']}K{tcfg['BLOCK_K']}"
                        tiles_per_split, n_splits = vocab_split_plan(triton.cdiv(n, tcfg["BLOCK_M"]),
                                                                     triton.cdiv(V, tcfg["BLOCK_N"]), 264)
                        add(f"topk[{ttag} k<={tcfg['K_BLOCK']}{' softcap' if softcap else ''}]", _topk_kernel,
                            {"a_ptr": "*" + dt, "w_ptr": "*" + wt, "pkey_ptr": "*i64", "pmax_ptr": "*fp32",
                             "psum_ptr": "*fp32", "softcap": "fp32"},
                            {"stride_am": H, "stride_wn": H, "N": n, "V": V, "H": H,
                             "tiles_per_split": tiles_per_split, "n_splits": n_splits},
                            {k_: tcfg[k_] for k_ in ("BLOCK_M", "BLOCK_N", "BLOCK_K", "K_BLOCK")}
                            | dict(DOT_FP32=dot == torch.float32, HAS_SOFTCAP=softcap),
                            tcfg["num_warps"], tcfg["num_stages"], tc, tcfg["maxnreg"])
            for V_noise in (V, 4096):  # a whole vocabulary row (processed sampling's dense path), a chunk
                add(f"gumbel_noise[R{NOISE_BLOCK_R}xC{NOISE_BLOCK_C}]", _gumbel_noise_kernel,
                    {"seed_ptr": "*i64", "out_ptr": "*fp32"},
                    {"stride_o": V_noise, "n_rows": 16, "n_cols": V_noise, "row0": 0, "col0": 0},
                    {"BLOCK_R": NOISE_BLOCK_R, "BLOCK_C": NOISE_BLOCK_C}, NOISE_NUM_WARPS, 1)
    return collect.out
