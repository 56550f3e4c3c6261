"""DDTree verification attention over a packed ancestor bitmask (SPEC 7.3).

The target verifies ``T = N + 1`` tree tokens (root, then nodes in pop order)
in one pass. Query ``i`` sees every key of the committed prefix, and among the
tree keys only itself and its ancestors: bit ``j`` of ``bits[i]`` (see
:func:`dflash_kernels.ancestor_bits`).

* :func:`tree_attention`: FlashAttention-2 style Triton kernel. Each program
  owns ``BLOCK_M`` queries of one head and walks key tiles of ``BLOCK_N`` with
  an online softmax in float32: first the prefix tiles (no mask), then the
  tree tiles up to the program's last query (tree keys past a query are never
  its ancestors), whose visibility comes from the bitmask words. No dense
  ``[T, S]`` mask exists anywhere. When the ``(query tile, head)`` grid is too
  small to fill the GPU (short trees, long prefixes), the key axis is split
  across programs that write partial ``(output, log-sum-exp)`` pairs, merged
  by a second small kernel (flash-decoding style).
* :func:`tree_attention_mask`: the dense additive mask, for attention backends
  that need one (SDPA, eager).

The reference of both is :mod:`dflash_kernels.reference.tree_attention`.
"""

from __future__ import annotations

import functools
from typing import List, Optional, Tuple

import torch
import triton
import triton.language as tl

from . import reference as _reference
from ._dispatch import get_backend, triton_interpreting

__all__ = ["tree_attention", "tree_attention_mask"]

_LOG2E = 1.4426950408889634
_MASK_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_ATTENTION_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


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


def _check_bits(bits: torch.Tensor, n_tree: int, who: str) -> None:
    if not isinstance(bits, torch.Tensor):
        raise TypeError(f"{who}: bits must be a torch.Tensor, got {type(bits).__name__}")
    if bits.dtype != torch.int32:
        raise ValueError(f"{who}: bits must be int32 (from ancestor_bits), got {bits.dtype}")
    if bits.dim() != 2 or bits.shape[0] != n_tree or bits.shape[1] < triton.cdiv(n_tree, 32):
        raise ValueError(
            f"{who}: bits must be [T, >= ceil(T/32)] = [{n_tree}, >= {triton.cdiv(n_tree, 32)}], "
            f"got {tuple(bits.shape)}"
        )


def _check_prefix_len(prefix_len: int, who: str) -> None:
    if not isinstance(prefix_len, int) or isinstance(prefix_len, bool) or prefix_len < 0:
        raise ValueError(f"{who}: prefix_len must be an int >= 0, got {prefix_len!r}")


def tree_attention_mask_triton(bits: torch.Tensor, prefix_len: int, dtype: torch.dtype) -> torch.Tensor:
    """Triton launcher of :func:`tree_attention_mask`."""
    n_tree = bits.shape[0]
    n_keys = prefix_len + n_tree
    mask = torch.empty(n_tree, n_keys, dtype=dtype, device=bits.device)
    if n_tree == 0:
        return mask
    cfg = TREE_MASK_CONFIGS[0]
    grid = (triton.cdiv(n_tree, cfg["BLOCK_T"]), triton.cdiv(n_keys, cfg["BLOCK_K"]))
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

@triton.jit
def _online_softmax_step(q, k, v, visible, m_i, l_i, acc, qk_scale,
                         DOT_FP32: tl.constexpr, INPUT_PRECISION: tl.constexpr):
    """Fold one key tile into the running (max, sum, accumulator), base 2.

    ``q [M, D]``, ``k [D, N]``, ``v [N, D]``, ``visible [M, N]``. Scores are
    ``q k * scale * log2(e)``; hidden ones are ``-inf``. A row that has seen
    no visible key yet keeps ``m = -inf``: the exponent base then falls back
    to 0 so that no ``-inf - -inf`` appears.
    """
    qk = tl.dot(q, k, input_precision=INPUT_PRECISION) * qk_scale
    qk = tl.where(visible, qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, axis=1))
    m_base = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.math.exp2(m_i - m_base)
    p = tl.math.exp2(qk - m_base[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    if DOT_FP32:
        pv = tl.dot(p, v, input_precision=INPUT_PRECISION)
    else:
        pv = tl.dot(p.to(v.dtype), v, input_precision=INPUT_PRECISION)
    acc = acc * alpha[:, None] + pv
    return m_new, l_i, acc


@triton.jit
def _tree_attention_kernel(
    q_ptr, k_ptr, v_ptr, bits_ptr, out_ptr, part_out_ptr, part_lse_ptr,
    stride_qh, stride_qt, stride_qd,
    stride_kh, stride_ks, stride_kd,
    stride_vh, stride_vs, stride_vd,
    stride_bits_row, stride_bits_word,
    stride_oh, stride_ot, stride_od,
    n_tree, prefix_len, head_dim, group, tiles_per_split, qk_scale,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    SPLIT_KEYS: tl.constexpr, DOT_FP32: tl.constexpr, INPUT_PRECISION: tl.constexpr,
):
    """Program (query tile, query head, key split).

    The key axis is cut in ``BLOCK_N`` tiles: ``ceil(prefix_len / BLOCK_N)``
    prefix tiles, then the tree tiles (node ``j`` at key ``prefix_len + j``).
    Split ``s`` owns tiles ``[s * tiles_per_split, (s + 1) * tiles_per_split)``.
    Without ``SPLIT_KEYS`` (one split) the normalized output is stored
    directly; otherwise ``(output, log2-sum-exp)`` partials go to the
    workspace. The split count is the grid's third dim, not a constexpr, so
    changing it does not recompile.
    """
    tile = tl.program_id(0)
    head = tl.program_id(1)
    split = tl.program_id(2)
    kv_head = head // group

    offs_m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    m_ok = offs_m < n_tree
    d_ok = offs_d < head_dim

    q_base = q_ptr + head.to(tl.int64) * stride_qh
    q = tl.load(q_base + offs_m[:, None] * stride_qt + offs_d[None, :] * stride_qd,
                mask=m_ok[:, None] & d_ok[None, :], other=0.0)
    if DOT_FP32:
        q = q.to(tl.float32)
    k_base = k_ptr + kv_head.to(tl.int64) * stride_kh
    v_base = v_ptr + kv_head.to(tl.int64) * stride_vh

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    # Key tiles: units [0, prefix_tiles) are prefix tiles, the next ones are
    # tree tiles aligned on node indices (so that a tile covers whole bitmask
    # words). Split `split` owns units [lo, lo + tiles_per_split); tree tiles
    # past this query tile's last node are skipped (never ancestors).
    prefix_tiles = tl.cdiv(prefix_len, BLOCK_N)
    lo = split * tiles_per_split
    hi = tl.minimum(lo + tiles_per_split, prefix_tiles + tl.cdiv(tl.minimum(n_tree, (tile + 1) * BLOCK_M), BLOCK_N))

    # Prefix keys: visible to every query; only the ragged end is masked.
    for unit in range(lo, tl.minimum(hi, prefix_tiles)):
        offs_n = unit * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = offs_n < prefix_len
        k = tl.load(k_base + offs_n[None, :] * stride_ks + offs_d[:, None] * stride_kd,
                    mask=n_ok[None, :] & d_ok[:, None], other=0.0)
        v = tl.load(v_base + offs_n[:, None] * stride_vs + offs_d[None, :] * stride_vd,
                    mask=n_ok[:, None] & d_ok[None, :], other=0.0)
        if DOT_FP32:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        visible = m_ok[:, None] & n_ok[None, :]
        m_i, l_i, acc = _online_softmax_step(q, k, v, visible, m_i, l_i, acc, qk_scale, DOT_FP32, INPUT_PRECISION)

    # Tree keys: node j is visible to query i iff bit j of bits[i] is set.
    lane = tl.arange(0, BLOCK_N)
    bits_rows = bits_ptr + offs_m.to(tl.int64) * stride_bits_row
    for unit in range(tl.maximum(lo, prefix_tiles), hi):
        first_node = (unit - prefix_tiles) * BLOCK_N
        nodes = first_node + lane
        n_ok = nodes < n_tree
        offs_n = prefix_len + nodes
        k = tl.load(k_base + offs_n[None, :] * stride_ks + offs_d[:, None] * stride_kd,
                    mask=n_ok[None, :] & d_ok[:, None], other=0.0)
        v = tl.load(v_base + offs_n[:, None] * stride_vs + offs_d[None, :] * stride_vd,
                    mask=n_ok[:, None] & d_ok[None, :], other=0.0)
        if DOT_FP32:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        # One bitmask word per query row and 32 keys: a [BLOCK_M] load each,
        # expanded against the lanes it covers (no [BLOCK_M, BLOCK_N] gather).
        visible = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.int32)
        for w in tl.static_range(BLOCK_N // 32):
            word_index = first_node // 32 + w
            word = tl.load(bits_rows + word_index * stride_bits_word,
                           mask=m_ok & (offs_m * 0 + word_index * 32 < n_tree), other=0)
            in_word = (lane // 32) == w
            bit = (word[:, None] >> (lane % 32)[None, :]) & 1
            visible = visible | tl.where(in_word[None, :], bit, 0)
        visible = (visible != 0) & n_ok[None, :]
        m_i, l_i, acc = _online_softmax_step(q, k, v, visible, m_i, l_i, acc, qk_scale, DOT_FP32, INPUT_PRECISION)

    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    out = acc / l_safe[:, None]
    md_ok = m_ok[:, None] & d_ok[None, :]
    if not SPLIT_KEYS:
        o_base = out_ptr + head.to(tl.int64) * stride_oh
        tl.store(o_base + offs_m[:, None] * stride_ot + offs_d[None, :] * stride_od,
                 out.to(out_ptr.dtype.element_ty), mask=md_ok)
    else:
        # Workspace: part_out [splits, Hq, n_tree, head_dim], part_lse [splits, Hq, n_tree].
        n_heads = tl.num_programs(1)
        row = (split * n_heads + head).to(tl.int64) * n_tree
        lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.math.log2(l_safe))
        tl.store(part_lse_ptr + row + offs_m, lse, mask=m_ok)
        tl.store(part_out_ptr + (row + offs_m[:, None]) * head_dim + offs_d[None, :], out, mask=md_ok)


@triton.jit
def _merge_splits_kernel(
    part_out_ptr, part_lse_ptr, out_ptr, n_tree, head_dim, num_splits,
    stride_oh, stride_ot, stride_od,
    BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Merge per-split partials: ``out = sum_s 2^(lse_s - M) o_s / sum_s 2^(lse_s - M)``."""
    tile = tl.program_id(0)
    head = tl.program_id(1)
    n_heads = tl.num_programs(1)
    offs_m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    m_ok = offs_m < n_tree
    md_ok = m_ok[:, None] & (offs_d < head_dim)[None, :]
    m_run = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    w_sum = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    for split in range(0, num_splits):
        row = (split * n_heads + head).to(tl.int64) * n_tree
        lse = tl.load(part_lse_ptr + row + offs_m, mask=m_ok, other=float("-inf"))
        part = tl.load(part_out_ptr + (row + offs_m[:, None]) * head_dim + offs_d[None, :], mask=md_ok, other=0.0)
        m_new = tl.maximum(m_run, lse)
        m_base = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.math.exp2(m_run - m_base)
        weight = tl.math.exp2(lse - m_base)
        acc = acc * alpha[:, None] + part * weight[:, None]
        w_sum = w_sum * alpha + weight
        m_run = m_new
    out = acc / tl.where(w_sum == 0.0, 1.0, w_sum)[:, None]
    o_base = out_ptr + head.to(tl.int64) * stride_oh
    tl.store(o_base + offs_m[:, None] * stride_ot + offs_d[None, :] * stride_od,
             out.to(out_ptr.dtype.element_ty), mask=md_ok)


# ----------------------------------------------------------------------------
# Launcher
# ----------------------------------------------------------------------------

def head_dim_block(head_dim: int) -> int:
    """Padded head dim of the kernel's tiles: the next power of two, at least 16."""
    return max(16, triton.next_power_of_2(head_dim))


def tree_attention_configs(head_dim: int, dtype: torch.dtype) -> List[dict]:
    """Every launch configuration :func:`tree_attention` can choose for this head dim and dtype.

    Keys: ``BLOCK_M``, ``BLOCK_N``, ``BLOCK_D``, ``num_warps``, ``num_stages``.
    Query tiles shrink to 16 / 32 rows for small trees; key tiles and stages
    shrink for wide heads and float32 so the pipelined K/V tiles fit in shared
    memory on sm_80 (164 KiB) as well as sm_90.
    """
    block_d = head_dim_block(head_dim)
    wide = block_d * (4 if dtype == torch.float32 else 2)  # bytes per key row
    if wide <= 256:
        block_n, warps, stages = 64, 4, 3
    elif wide <= 512:
        block_n, warps, stages = 32, 4, 2
    else:
        block_n, warps, stages = 32, 8, 2
    return [
        {"BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_D": block_d, "num_warps": warps, "num_stages": stages}
        for block_m in (16, 32, 64)
    ]


def tree_attention_config(head_dim: int, dtype: torch.dtype, n_tree: int) -> dict:
    """The configuration chosen for ``n_tree`` queries (smallest query tile that is not mostly padding)."""
    configs = tree_attention_configs(head_dim, dtype)
    if n_tree <= 16:
        return configs[0]
    if n_tree <= 32:
        return configs[1]
    return configs[2]


@functools.lru_cache(maxsize=None)
def _multiprocessor_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def choose_num_splits(device: torch.device, programs: int, n_keys: int, block_n: int) -> int:
    """Key splits so that ``programs * splits`` covers the GPU about twice, each split >= 4 key tiles."""
    if device.type != "cuda":
        return 1
    sms = _multiprocessor_count(device.index if device.index is not None else torch.cuda.current_device())
    if programs >= sms:
        return 1
    wanted = triton.cdiv(2 * sms, programs)
    most = max(1, n_keys // (4 * block_n))
    return max(1, min(wanted, most, 64))


def _squeeze_batch(x: torch.Tensor, name: str) -> Tuple[torch.Tensor, bool]:
    if x.dim() == 4:
        if x.shape[0] != 1:
            raise ValueError(f"tree_attention: {name} with a batch dim must have batch size 1, got {tuple(x.shape)}")
        return x[0], True
    if x.dim() != 3:
        raise ValueError(f"tree_attention: {name} must be [H, T, D] or [1, H, T, D], got {tuple(x.shape)}")
    return x, False


def _check_attention_inputs(query, key, value, bits, prefix_len):
    for name, t in (("query", query), ("key", key), ("value", value), ("bits", bits)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"tree_attention: {name} must be a torch.Tensor, got {type(t).__name__}")
    _check_prefix_len(prefix_len, "tree_attention")
    q, batched = _squeeze_batch(query, "query")
    k, _ = _squeeze_batch(key, "key")
    v, _ = _squeeze_batch(value, "value")
    hq, n_tree, d = q.shape
    hkv, s, dk = k.shape
    if v.shape != k.shape:
        raise ValueError(f"tree_attention: value shape {tuple(v.shape)} must equal key shape {tuple(k.shape)}")
    if dk != d:
        raise ValueError(f"tree_attention: query head dim {d} != key head dim {dk}")
    if not 1 <= d <= 256:
        raise ValueError(f"tree_attention: head dim must be in 1..256, got {d}")
    if hkv == 0 or hq % hkv != 0:
        raise ValueError(f"tree_attention: query heads ({hq}) must be a multiple of kv heads ({hkv})")
    if s != prefix_len + n_tree:
        raise ValueError(
            f"tree_attention: key/value length {s} must be prefix_len + T = {prefix_len} + {n_tree}; "
            "slice the cache view to the live positions"
        )
    if not (query.dtype == key.dtype == value.dtype) or query.dtype not in _ATTENTION_DTYPES:
        raise ValueError(
            f"tree_attention: query/key/value must share one dtype among {_ATTENTION_DTYPES}, "
            f"got {query.dtype}/{key.dtype}/{value.dtype}"
        )
    devices = {query.device, key.device, value.device, bits.device}
    if len(devices) != 1:
        raise ValueError(f"tree_attention: all tensors must be on one device, got {sorted(map(str, devices))}")
    _check_bits(bits, n_tree, "tree_attention")
    return q, k, v, batched


def tree_attention_triton(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    bits: torch.Tensor,
    prefix_len: int,
    scale: Optional[float] = None,
    num_splits: Optional[int] = None,
    config: Optional[dict] = None,
) -> torch.Tensor:
    """Triton launcher of :func:`tree_attention` (validates, then launches).

    ``num_splits`` (key-axis splits) and ``config`` (one of
    :func:`tree_attention_configs`) override the launcher's choice; tests use
    them to run every code path.
    """
    q, k, v, batched = _check_attention_inputs(query, key, value, bits, prefix_len)
    return _launch(q, k, v, bits, prefix_len, scale, batched, num_splits, config)


def _launch(q, k, v, bits, prefix_len, scale, batched, num_splits=None, config=None):
    hq, n_tree, head_dim = q.shape
    group = hq // k.shape[0]
    n_keys = prefix_len + n_tree
    scale = head_dim**-0.5 if scale is None else float(scale)
    cfg = config or tree_attention_config(head_dim, q.dtype, n_tree)
    block_m, block_n = cfg["BLOCK_M"], cfg["BLOCK_N"]
    if block_n % 32 != 0 or block_m < 16:
        raise ValueError(f"tree_attention: config needs BLOCK_N % 32 == 0 and BLOCK_M >= 16, got {cfg}")
    tiles = triton.cdiv(n_tree, block_m)
    if num_splits is None:
        num_splits = choose_num_splits(q.device, tiles * hq, n_keys, block_n)
    if num_splits < 1:
        raise ValueError(f"tree_attention: num_splits must be >= 1, got {num_splits}")
    key_tiles = triton.cdiv(prefix_len, block_n) + triton.cdiv(n_tree, block_n)
    num_splits = min(num_splits, key_tiles)
    tiles_per_split = triton.cdiv(key_tiles, num_splits)

    out = torch.empty(hq, n_tree, head_dim, dtype=q.dtype, device=q.device)
    if n_tree == 0:
        return out.unsqueeze(0) if batched else out
    if num_splits > 1:
        part_out = torch.empty(num_splits, hq, n_tree, head_dim, dtype=torch.float32, device=q.device)
        part_lse = torch.empty(num_splits, hq, n_tree, dtype=torch.float32, device=q.device)
    else:
        part_out = part_lse = out  # unused
    dot_fp32 = triton_interpreting()
    precision = "ieee" if q.dtype == torch.float32 else "tf32"
    _tree_attention_kernel[(tiles, hq, num_splits)](
        q, k, v, bits, out, part_out, part_lse,
        q.stride(0), q.stride(1), q.stride(2),
        k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2),
        bits.stride(0), bits.stride(1),
        out.stride(0), out.stride(1), out.stride(2),
        n_tree, prefix_len, head_dim, group, tiles_per_split, scale * _LOG2E,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=cfg["BLOCK_D"], SPLIT_KEYS=num_splits > 1,
        DOT_FP32=dot_fp32, INPUT_PRECISION=precision,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    if num_splits > 1:
        _merge_splits_kernel[(tiles, hq)](
            part_out, part_lse, out, n_tree, head_dim, num_splits,
            out.stride(0), out.stride(1), out.stride(2),
            BLOCK_M=block_m, BLOCK_D=cfg["BLOCK_D"], num_warps=4,
        )
    return out.unsqueeze(0) if batched else out


def tree_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    bits: torch.Tensor,
    prefix_len: int,
    scale: Optional[float] = None,
) -> torch.Tensor:
    """Attention of the tree tokens over ``[committed prefix ; tree]`` keys.

    Args:
        query: ``[Hq, T, D]`` or ``[1, Hq, T, D]``; T = N + 1 tree tokens in node order.
        key, value: ``[Hkv, S, D]`` or ``[1, Hkv, S, D]``, ``S = prefix_len + T``;
            any strides (e.g. ``cache[l, 0, :, :S]`` of a ``[L, 2, Hkv, Smax, D]``
            buffer): nothing is copied. ``Hq % Hkv == 0``; query head ``h`` reads
            kv head ``h // (Hq // Hkv)``.
        bits: ``[T, >= ceil(T/32)]`` int32 ancestor bitmask from :func:`ancestor_bits`.
        prefix_len: committed keys, visible to every query.
        scale: softmax scale, default ``D ** -0.5``.

    Returns:
        ``softmax(q k^T * scale + mask) v`` in the query's dtype and rank,
        accumulated in float32; the mask hides tree key ``j`` from query ``i``
        unless bit ``j`` of ``bits[i]`` is set. fp16/bf16/fp32 inputs.
    """
    q, k, v, batched = _check_attention_inputs(query, key, value, bits, prefix_len)
    if get_backend(query.device) == "triton":
        return _launch(q, k, v, bits, prefix_len, scale, batched)
    return _reference.tree_attention(query, key, value, bits, prefix_len, scale)
