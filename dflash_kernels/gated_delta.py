"""Gated-DeltaNet ops for hybrid targets: tree scan, path replay, tree conv, conv window.

A hybrid target's linear-attention layer keeps a recurrent state ``S [Hv, Dk,
Dv]`` (fp32) and a causal-conv window ``[K-1, C]``. Speculative verification
runs a chain (DFlash) or a tree (DDTree) of ``N`` tokens through the layer in
one pass; the commit must leave the state after exactly the accepted path.
Math (see :mod:`dflash_kernels.reference.gated_delta`), per value head ``h``,
key head ``h // (Hv // Hk)``, node ``i`` with parent state ``S_p``::

    S' = exp(g_i) S_p ;  delta = beta_i (v_i - S'^T k_i) ;  S_i = S' + k_i delta^T ;  o_i = S_i^T q_i

Every op takes one sequence or a batch of ``b`` sequences (a leading ``[b]``
on each per-sequence tensor, after the layer dim where there is one): each
sequence has its own committed state and window, its own tree (``parents [b,
N]``; the node count ``N`` is shared) and its own accepted rows and count
(``rows [b, A]``, ``num_rows [b]``). One sequence is the batch of one: the
same kernels and launchers, so its results are those of a batch row.

Ops (Triton on CUDA / the interpreter, else the reference; ``get_backend``):

* :func:`gated_delta_tree` (Triton): outputs of every node of a tree (or chain).
* :func:`gated_delta_replay_` (Triton): advances the committed state, in
  place, through the accepted rows; the row count stays on the device; one
  launch for ``L`` layers at once.
* :func:`causal_conv_tree` (Triton): the depthwise causal conv where a node's
  taps are its ancestors (then the window).
* :func:`conv_window_after` (torch index math on every backend): the window
  after the accepted rows.

Tree-scan kernel
----------------
Grid ``(Hv, cdiv(Dv, BV), b)``: a program (one CTA) owns the ``[Dk, BV]``
slice of one value head's state of one sequence, fp32 in registers, and walks
that sequence's nodes in index order. When ``parents[i] == i - 1`` (every step of a chain) the registers
already hold the parent's state: no state traffic at all. Otherwise it loads
the parent's slice, from ``state`` when the parent is ``-1`` or from the
per-node ``scratch`` that it stored at the parent's own iteration. Every
node's slice is stored (``store_states="all"``), or only the slices some
later node reloads (``"branches"``: nodes with a child other than ``i + 1``).

Why no thread reads a scratch slice before it is written
--------------------------------------------------------
Inside one CTA, element ``(k, v)`` of node ``p``'s slice is stored by one
thread at iteration ``p`` and may be loaded by another thread (the layout of
the load need not equal the store's, and small tiles replicate elements
across threads) at an iteration ``i > p`` with ``parents[i] == p != i - 1``.

1. The reload happens only under ``p != i - 1``; ``p`` is one value every
   thread loads from the same address (``parents`` is read-only here), so the
   branch is uniform across the CTA and every thread executes the barrier
   (``tl.debug_barrier()``, PTX ``bar.sync 0``) placed just before the load.
2. Every thread issued its stores of iterations ``0 .. i-1``, node ``p``'s
   among them, before that barrier in program order; the load comes after it.
   ``bar.sync`` orders the memory accesses of the participating threads (PTX
   ISA: accesses requested before the barrier are performed relative to all
   of them), and the compiler cannot move a global access across it. So the
   load sees node ``p``'s stored slice.
3. Node ``p``'s slice is stored: always with ``"all"``; with ``"branches"``
   its flag is set precisely because node ``i`` (``parents[i] = p``, ``i !=
   p + 1``) reloads it. Each scratch slot is written once (at its own
   iteration), so no later store overwrites a slice before a reader.
4. Different programs own different ``(sequence, h, v-columns)``, i.e.
   disjoint scratch and output elements (a sequence's scratch and outputs are
   its own ``[r]`` rows) and read disjoint state elements: no ordering
   between CTAs is needed. ``state``,
   ``q``, ``k``, ``v``, ``g``, ``beta`` and ``parents`` are only read; the
   caller must not alias ``scratch`` or ``out`` with them. A parent ``-1``
   reloads from ``state``, which nothing writes: no hazard there.
5. The reload is a plain coherent ``ld.global`` (not the read-only ``.nc``
   path, which may serve a stale line); ``tests/ops/test_compile_gpu_gated_delta.py``
   checks that, and that a ``bar.sync`` lies between every ``parents[i]``
   load and the next global load, in the sm_90 / sm_80 PTX.

A program is one warp (``state_config``), so the barrier costs little; it is
still required, since a warp's lanes give no ordering guarantee to each
other's global accesses without one. With ``"branches"`` the store itself is
under ``flags[i] != 0``, again one value for the whole CTA.

Replay kernel
-------------
Grid ``(L * b, Hv, cdiv(Dv, BV))`` (program ``l * b + r`` on axis 0: layer
``l`` of sequence ``r``): load the slice, read ``n = clamp(num_rows[r], 0,
A)`` on the device, loop ``j < n`` (row ``rows[r, j]``, one load each), then
store the slice over the one it loaded (a count of 0 stores what it loaded:
a stopped sequence's state is unchanged). The store overwrites elements other
threads loaded at the start (write after read): a ``tl.debug_barrier()``
before the store makes every thread's initial load performed first (same
argument as above; the loop bound is one loaded value, so the barrier is
uniform). Programs own disjoint slices: distinct ``(l, r, h, v-block)``
address distinct elements of ``state [L, b, Hv, Dk, Dv]``.

Conv kernel (Triton, not torch)
-------------------------------
The torch form (the reference) needs the ``[N, K]`` tap indices (``K - 1``
dependent steps of a few ops each), a concatenation, a gather, ``conv1d`` and
the activation: some 20 launches per layer per round at ``K = 4``, against
one kernel that follows the parent pointers itself and reads every input
once (the launch count, not the bytes, is what costs at these sizes).
Grid ``(cdiv(N, BN), cdiv(C, BC), b)`` (sequence ``r`` reads its own ``x``,
window and parents and writes its own output rows); fp32 accumulation of
``weight[:, K-1-m] * tap_m`` after casting each tap to the weight's dtype
(transformers casts the concatenated inputs to the weight's dtype), the conv
result rounded to the weight's dtype, the SiLU in fp32 rounded again (as
torch's SiLU on a half tensor), then cast to ``x``'s dtype. Loads only, one
store per output element: no hazards.

Recompiles: the node and row counts are ``do_not_specialize``; tiles depend
on ``Dk, Dv`` (state) or nothing (conv).
"""

from __future__ import annotations

from typing import List, Optional

import torch
import triton
import triton.language as tl
from torch import Tensor

from . import reference as _reference
from ._declare import declare, dispatch

__all__ = ["gated_delta_tree", "gated_delta_replay_", "causal_conv_tree", "conv_window_after"]

#: Integer kernel arguments that vary per round: never specialized (no recompiles).
TREE_DYNAMIC_INTS = ("n_nodes",)
REPLAY_DYNAMIC_INTS = ("n_rows",)
CONV_DYNAMIC_INTS = ("n_nodes",)
#: The replay's row count is a device scalar the caller may hand as a slice of a longer tensor at any offset
#: (the hybrid cache's cached arange of counts): no 16-byte alignment hint, so a count at an odd offset never
#: compiles a second binary mid-generation.
REPLAY_UNALIGNED_PTRS = ("count_ptr",)

#: Store modes of the tree kernel (constexpr STORE): none (a chain without scratch), every node, flagged nodes.
STORE_NONE, STORE_ALL, STORE_FLAGGED = 0, 1, 2
STORE_STATES = ("all", "branches")

#: Conv tile: nodes x channels per program.
CONV_BLOCK_N, CONV_BLOCK_C, CONV_NUM_WARPS = 16, 128, 4
ACTIVATIONS = ("silu", None)

_TRITON_TYPE = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.int64: "i64",
                torch.int32: "i32"}


def state_config(dim_k: int, dim_v: int) -> dict:
    """Tiles of the tree / replay kernels: one warp per program, ``BK`` covering all of ``Dk`` (the
    reductions run over it) and ``BV`` value columns, ``BK * BV <= 1024`` (32 fp32 state elements per
    thread; ``[128, 8]`` at Qwen3.5's ``Dk = 128``).

    One warp makes both reductions over ``Dk`` warp shuffles: no shared-memory round trip and CTA
    barrier per step (4 warps on a ``[128, 32]`` tile take 14 ``bar.sync`` per step against 3). The
    grid ``Hv * Dv / BV`` (768 programs at 48 heads) covers the GPU's SMs several times over.
    """
    bk = max(16, triton.next_power_of_2(dim_k))
    bv = min(max(4, triton.next_power_of_2(dim_v)), max(4, 1024 // bk))
    return {"BK": bk, "BV": bv, "num_warps": 1, "num_stages": 1}


# --------------------------------------------------------------------------- kernels


@triton.jit
def _l2norm(x, QK_L2NORM: tl.constexpr):
    if QK_L2NORM:
        x = x * tl.rsqrt(tl.sum(x * x, axis=0) + 1e-6)
    return x


@triton.jit(do_not_specialize=TREE_DYNAMIC_INTS)
def _gated_delta_tree_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr,  # [b, N, Hk, Dk] x2, [b, N, Hv, Dv], [b, N, Hv] x2
    state_ptr,  # fp32 [b, Hv, Dk, Dv], read only
    parents_ptr,  # int [b, N] (unused with CHAIN)
    flags_ptr,  # int32 [b, N]: store node i's slice (read with STORE == 2 only)
    out_ptr,  # [b, N, Hv, Dv] in v's dtype
    scratch_ptr,  # fp32 [b, >= N, Hv, Dk, Dv] per-node states (unused with STORE == 0)
    n_nodes, group, dim_k, dim_v, scale,
    stride_qb, stride_qn, stride_qh, stride_qd,
    stride_kb, stride_kn, stride_kh, stride_kd,
    stride_vb, stride_vn, stride_vh, stride_vd,
    stride_gb, stride_gn, stride_gh,
    stride_bb, stride_bn, stride_bh,
    stride_sb, stride_sh, stride_sk, stride_sv,
    stride_pb, stride_fb,
    stride_ob, stride_on, stride_oh, stride_od,
    stride_xb, stride_xn, stride_xh, stride_xk, stride_xv,
    CHAIN: tl.constexpr, STORE: tl.constexpr, QK_L2NORM: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
):
    """Program (value head h, value columns block, sequence r): the nodes of sequence r's tree in order, the
    state slice in registers. Every pointer is first moved to sequence r's rows (its own tree, state, scratch
    and outputs)."""
    h = tl.program_id(0).to(tl.int64)
    r = tl.program_id(2).to(tl.int64)
    q_ptr += r * stride_qb
    k_ptr += r * stride_kb
    v_ptr += r * stride_vb
    g_ptr += r * stride_gb
    beta_ptr += r * stride_bb
    parents_ptr += r * stride_pb
    flags_ptr += r * stride_fb
    out_ptr += r * stride_ob
    hk = h // group
    offs_k = tl.arange(0, BK)
    offs_v = tl.program_id(1) * BV + tl.arange(0, BV)
    k_ok = offs_k < dim_k
    v_ok = offs_v < dim_v
    tile_ok = k_ok[:, None] & v_ok[None, :]
    state_tile = (state_ptr + r * stride_sb + h * stride_sh + offs_k[:, None] * stride_sk
                  + offs_v[None, :] * stride_sv)
    scratch_tile = (scratch_ptr + r * stride_xb + h * stride_xh + offs_k[:, None] * stride_xk
                    + offs_v[None, :] * stride_xv)
    s = tl.load(state_tile, mask=tile_ok, other=0.0)
    for i in range(n_nodes):
        row = tl.cast(i, tl.int64)
        if not CHAIN:
            p = tl.load(parents_ptr + row).to(tl.int64)
            if p != row - 1:
                # Uniform branch (one scalar for the CTA). Every store of nodes < i, by every thread,
                # is performed before the parent's slice is read back (module docstring, points 1-3).
                tl.debug_barrier()
                src = tl.where(p < 0, state_tile, scratch_tile + tl.maximum(p, 0) * stride_xn)
                s = tl.load(src, mask=tile_ok, other=0.0)
        q = tl.load(q_ptr + row * stride_qn + hk * stride_qh + offs_k * stride_qd, mask=k_ok, other=0.0)
        k = tl.load(k_ptr + row * stride_kn + hk * stride_kh + offs_k * stride_kd, mask=k_ok, other=0.0)
        v = tl.load(v_ptr + row * stride_vn + h * stride_vh + offs_v * stride_vd, mask=v_ok, other=0.0)
        g = tl.load(g_ptr + row * stride_gn + h * stride_gh).to(tl.float32)
        beta = tl.load(beta_ptr + row * stride_bn + h * stride_bh).to(tl.float32)
        q = _l2norm(q.to(tl.float32), QK_L2NORM) * scale
        k = _l2norm(k.to(tl.float32), QK_L2NORM)
        s = s * tl.exp(g)
        kv = tl.sum(s * k[:, None], axis=0)
        delta = (v.to(tl.float32) - kv) * beta
        s = s + k[:, None] * delta[None, :]
        o = tl.sum(s * q[:, None], axis=0)
        tl.store(out_ptr + row * stride_on + h * stride_oh + offs_v * stride_od,
                 o.to(out_ptr.dtype.element_ty), mask=v_ok)
        if STORE == 1:
            tl.store(scratch_tile + row * stride_xn, s, mask=tile_ok)
        if STORE == 2:
            if tl.load(flags_ptr + row) != 0:
                tl.store(scratch_tile + row * stride_xn, s, mask=tile_ok)


@triton.jit(do_not_specialize=REPLAY_DYNAMIC_INTS, do_not_specialize_on_alignment=REPLAY_UNALIGNED_PTRS)
def _gated_delta_replay_kernel(
    state_ptr,  # fp32 [L, b, Hv, Dk, Dv], advanced in place
    k_ptr, v_ptr, g_ptr, beta_ptr,  # [L, b, N, Hk, Dk], [L, b, N, Hv, Dv], [L, b, N, Hv] x2 (q: not needed)
    rows_ptr,  # int [b, A]: each sequence's accepted rows, in order (the same for every layer)
    count_ptr,  # int [b]: how many of them (read on the device)
    n_rows, n_batch, group, dim_k, dim_v,
    stride_sl, stride_sb, stride_sh, stride_sk, stride_sv,
    stride_kl, stride_kb, stride_kn, stride_kh, stride_kd,
    stride_vl, stride_vb, stride_vn, stride_vh, stride_vd,
    stride_gl, stride_gb, stride_gn, stride_gh,
    stride_bl, stride_bb, stride_bn, stride_bh,
    stride_rb, stride_cb,
    QK_L2NORM: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
):
    """Program (layer x sequence, value head, value columns block): the sequence's accepted rows in order,
    then one store."""
    pid = tl.program_id(0)
    layer = (pid // n_batch).to(tl.int64)
    r = (pid % n_batch).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    hk = h // group
    offs_k = tl.arange(0, BK)
    offs_v = tl.program_id(2) * BV + tl.arange(0, BV)
    k_ok = offs_k < dim_k
    v_ok = offs_v < dim_v
    tile_ok = k_ok[:, None] & v_ok[None, :]
    state_tile = (state_ptr + layer * stride_sl + r * stride_sb + h * stride_sh + offs_k[:, None] * stride_sk
                  + offs_v[None, :] * stride_sv)
    s = tl.load(state_tile, mask=tile_ok, other=0.0)
    k_base = k_ptr + layer * stride_kl + r * stride_kb + hk * stride_kh + offs_k * stride_kd
    v_base = v_ptr + layer * stride_vl + r * stride_vb + h * stride_vh + offs_v * stride_vd
    g_base = g_ptr + layer * stride_gl + r * stride_gb + h * stride_gh
    b_base = beta_ptr + layer * stride_bl + r * stride_bb + h * stride_bh
    rows_ptr += r * stride_rb
    n = tl.minimum(tl.maximum(tl.load(count_ptr + r * stride_cb).to(tl.int32), 0), n_rows)
    for j in range(0, n):
        row = tl.load(rows_ptr + j).to(tl.int64)
        k = tl.load(k_base + row * stride_kn, mask=k_ok, other=0.0)
        v = tl.load(v_base + row * stride_vn, mask=v_ok, other=0.0)
        g = tl.load(g_base + row * stride_gn).to(tl.float32)
        beta = tl.load(b_base + row * stride_bn).to(tl.float32)
        k = _l2norm(k.to(tl.float32), QK_L2NORM)
        s = s * tl.exp(g)
        kv = tl.sum(s * k[:, None], axis=0)
        delta = (v.to(tl.float32) - kv) * beta
        s = s + k[:, None] * delta[None, :]
    # Every thread's initial load of the slice is performed before any thread overwrites it.
    tl.debug_barrier()
    tl.store(state_tile, s, mask=tile_ok)


@triton.jit(do_not_specialize=CONV_DYNAMIC_INTS)
def _causal_conv_tree_kernel(
    x_ptr,  # [b, N, C]
    window_ptr,  # [b, K-1, C], oldest row first
    weight_ptr,  # [C, K]
    bias_ptr,  # [C] (read with HAS_BIAS only)
    parents_ptr,  # int [b, N] (unused with CHAIN)
    y_ptr,  # [b, N, C] in x's dtype
    n_nodes, channels,
    stride_xb, stride_xn, stride_xc, stride_wb, stride_wr, stride_wc, stride_fc, stride_fk, stride_pb,
    stride_yb, stride_yn, stride_yc,
    K: tl.constexpr, CHAIN: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr,
    BN: tl.constexpr, BC: tl.constexpr,
):
    """Program (node block, channel block, sequence r): walk each node's K taps up its ancestors in sequence
    r's tree, then r's window.

    ``e`` indexes ``concat(window, x)``: window row ``e`` when ``e < K-1``, else node ``e - (K-1)``.
    """
    r = tl.program_id(2).to(tl.int64)
    x_ptr += r * stride_xb
    window_ptr += r * stride_wb
    parents_ptr += r * stride_pb
    y_ptr += r * stride_yb
    nodes = tl.program_id(0) * BN + tl.arange(0, BN)
    offs_c = tl.program_id(1) * BC + tl.arange(0, BC)
    n_ok = nodes < n_nodes
    c_ok = offs_c < channels
    w_dtype = weight_ptr.dtype.element_ty
    e = nodes.to(tl.int64) + (K - 1)
    acc = tl.zeros((BN, BC), dtype=tl.float32)
    for m in tl.static_range(K):
        is_node = e >= K - 1
        node = tl.maximum(e - (K - 1), 0)
        from_x = tl.load(x_ptr + node[:, None] * stride_xn + offs_c[None, :] * stride_xc,
                         mask=(n_ok & is_node)[:, None] & c_ok[None, :], other=0.0)
        from_w = tl.load(window_ptr + tl.minimum(e, K - 2)[:, None] * stride_wr + offs_c[None, :] * stride_wc,
                         mask=(n_ok & (e < K - 1))[:, None] & c_ok[None, :], other=0.0)
        tap = tl.where(is_node[:, None], from_x, from_w).to(w_dtype).to(tl.float32)
        w = tl.load(weight_ptr + offs_c * stride_fc + (K - 1 - m) * stride_fk, mask=c_ok, other=0.0)
        acc += tap * w.to(tl.float32)[None, :]
        if m < K - 1:
            if CHAIN:
                p = node - 1
            else:
                p = tl.load(parents_ptr + node, mask=n_ok & is_node, other=-1).to(tl.int64)
            e = tl.where(is_node, tl.where(p >= 0, p + (K - 1), K - 2), e - 1)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_c, mask=c_ok, other=0.0).to(tl.float32)[None, :]
    y = acc.to(w_dtype).to(tl.float32)
    if SILU:
        y = (y * tl.sigmoid(y)).to(w_dtype).to(tl.float32)
    tl.store(y_ptr + nodes.to(tl.int64)[:, None] * stride_yn + offs_c[None, :] * stride_yc,
             y.to(y_ptr.dtype.element_ty), mask=n_ok[:, None] & c_ok[None, :])


# --------------------------------------------------------------------------- validation


def _name(t) -> str:
    return type(t).__name__


def _require_tensor(op, name, t):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{op}: {name} must be a torch.Tensor, got {_name(t)}")


def _require_float(op, name, t):
    if not t.dtype.is_floating_point:
        raise ValueError(f"{op}: {name} must be a floating-point tensor, got {t.dtype}")


def _require_index(op, name, t, device, shapes):
    _require_tensor(op, name, t)
    if t.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"{op}: {name} must be int64 or int32, got {t.dtype}")
    if t.device != device:
        raise ValueError(f"{op}: {name} must be on the inputs' device {device}, got {t.device}")
    if tuple(t.shape) not in shapes:
        allowed = " or ".join(str(list(s)) for s in shapes)
        raise ValueError(f"{op}: {name} must have shape {allowed}, got {list(t.shape)}")


def _require_rows(op, rows, device, batch=None):
    """``rows [A]`` (shared by every sequence), or ``[b, A]`` when ``batch`` is the batch ``b`` of a batched call."""
    _require_tensor(op, "rows", rows)
    dims = (1,) if batch is None else (1, 2)
    if rows.dim() not in dims or (rows.dim() == 2 and rows.shape[0] != batch):
        want = "1-D [A]" if batch is None else f"[A] (every sequence's) or [b, A] = [{batch}, A]"
        raise ValueError(f"{op}: rows must be {want}, got shape {list(rows.shape)}")
    _require_index(op, "rows", rows, device, [tuple(rows.shape)])


def _require_counts(op, num_rows, device, batch=None):
    """``num_rows [1]`` / ``[]``, or with a batch ``b`` also ``[b]`` (one count per sequence)."""
    shapes = [(1,), ()] if batch is None else [(batch,), (1,), ()]
    _require_index(op, "num_rows", num_rows, device, shapes)


def _check_rows_values(op, rows, num_rows, n):
    """Each sequence's count in ``[0, A]`` and its ``rows[:count]`` in ``[0, N)`` (host read: the debug path)."""
    table = rows.detach().cpu().reshape(-1, rows.shape[-1])
    counts = num_rows.detach().cpu().reshape(-1)
    a = rows.shape[-1]
    for r in range(max(table.shape[0], counts.numel())):
        count = int(counts[r if counts.numel() > 1 else 0])
        where = f" (sequence {r})" if max(table.shape[0], counts.numel()) > 1 else ""
        if not 0 <= count <= a:
            raise ValueError(f"{op}: num_rows = {count}{where} must be in [0, A] = [0, {a}] (A = len(rows))")
        picked = table[r if table.shape[0] > 1 else 0, :count]
        bad = (picked < 0) | (picked >= n)
        if bool(bad.any()):
            j = int(bad.nonzero()[0, 0])
            raise ValueError(f"{op}: rows[{j}] = {int(picked[j])}{where} is not a row of the verify pass [0, {n})")


def _check_qkv(op, q, k, v, g, beta, lead=(), lead_name="layer"):
    """Shapes, dtypes, devices: ``q, k [*lead, N, Hk, Dk]``, ``v [*lead, N, Hv, Dv]``, ``g, beta [*lead, N, Hv]``."""
    for name, t in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)):
        _require_tensor(op, name, t)
        _require_float(op, name, t)
    nl = len(lead)
    if q.dim() != 3 + nl or v.dim() != 3 + nl:
        if not nl:
            want = "[N, H, D]"
        elif lead_name == "layer":
            want = (f"[L, N, H, D] (a leading layer dim L = {lead[0]}, as the state's)" if nl == 1 else
                    f"[L, b, N, H, D] (leading layer and batch dims L = {lead[0]}, b = {lead[1]}, as the state's)")
        else:
            want = f"[b, N, H, D] (a leading batch dim b = {lead[0]}, as the state's)"
        raise ValueError(f"{op}: q, k and v must be {want}, got q {list(q.shape)} and v {list(v.shape)}")
    if k.shape != q.shape:
        raise ValueError(f"{op}: k must have q's shape {list(q.shape)}, got {list(k.shape)}")
    if tuple(q.shape[:nl]) != tuple(lead) or tuple(v.shape[:nl]) != tuple(lead):
        raise ValueError(f"{op}: q and v must have the leading {lead_name} dims {list(lead)}, got q {list(q.shape)}, "
                         f"v {list(v.shape)}")
    n, n_k_heads = q.shape[nl], q.shape[nl + 1]
    if v.shape[nl] != n:
        raise ValueError(f"{op}: q has {n} rows but v has {v.shape[nl]}")
    n_v_heads = v.shape[nl + 1]
    if n_k_heads == 0 or n_v_heads % n_k_heads:
        raise ValueError(f"{op}: value heads Hv = {n_v_heads} must be a multiple of key heads Hk = {n_k_heads}")
    for name, t in (("g", g), ("beta", beta)):
        if tuple(t.shape) != tuple(lead) + (n, n_v_heads):
            raise ValueError(f"{op}: {name} must have shape {list(lead) + [n, n_v_heads]}, got {list(t.shape)}")
    for name, t in (("k", k), ("v", v), ("g", g), ("beta", beta)):
        if t.device != q.device:
            raise ValueError(f"{op}: {name} is on {t.device} but q is on {q.device}")
    return n, n_k_heads, n_v_heads, q.shape[-1], v.shape[-1]


def _check_state(op, state, shape, device):
    _require_tensor(op, "state", state)
    if state.dtype != torch.float32:
        raise ValueError(f"{op}: state must be float32 (the recurrent state is kept in fp32), got {state.dtype}")
    if tuple(state.shape) != tuple(shape):
        raise ValueError(f"{op}: state must have shape {list(shape)}, got {list(state.shape)}")
    if state.device != device:
        raise ValueError(f"{op}: state is on {state.device} but q is on {device}")


def _check_scale(op, scale):
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float))):
        raise TypeError(f"{op}: scale must be None or a float, got {_name(scale)}")


def _check_parent_values(op, parents, n):
    """``parents[..., i]`` in ``[-1, i)`` for every sequence (host read: the debug path)."""
    par = parents.detach().to("cpu", torch.int64).reshape(-1, n)
    bad = (par < -1) | (par >= torch.arange(n))
    if bool(bad.any()):
        r, i = (int(x) for x in bad.nonzero()[0])
        where = f"[{r}, {i}]" if parents.dim() == 2 else f"[{i}]"
        raise ValueError(f"{op}: parents{where} = {int(par[r, i])} must be in [-1, {i}) (a parent precedes its child; "
                         "-1 means the committed state)")


# --------------------------------------------------------------------------- gated_delta_tree


def _branch_flags(parents: torch.Tensor, n: int) -> torch.Tensor:
    """int32 ``[b, N]``: 1 where some node ``j != i + 1`` of the same sequence has parent ``i`` (its slice is
    reloaded), from ``parents [b, N]``."""
    par = parents.to(torch.int64)
    idx = torch.arange(n, device=parents.device)
    jump = (par >= 0) & (par != idx - 1)
    flags = torch.zeros(par.shape[0], n + 1, dtype=torch.int32, device=parents.device)
    flags.scatter_(1, torch.where(jump, par, torch.full_like(par, n)), 1)
    return flags[:, :n]


def _tree_triton(q, k, v, g, beta, state, parents, scale, qk_l2norm, scratch, store_states):
    """The launch over a batch: ``q, k [b, N, Hk, Dk]``, ``v [b, N, Hv, Dv]``, ``g, beta [b, N, Hv]``, ``state [b,
    Hv, Dk, Dv]``, ``parents [b, N]`` or None, ``scratch [b, >= N, Hv, Dk, Dv]`` or None -> ``[b, N, Hv, Dv]``.

    Grid ``(Hv, cdiv(Dv, BV), b)``: program ``(h, j, r)`` reads sequence ``r``'s inputs, parents and state and
    writes only sequence ``r``'s outputs ``out[r, :, h, j-block]`` and scratch slices ``scratch[r, :, h, :,
    j-block]``: for ``r != r'`` those lie in different ``[r]`` rows of ``out`` / ``scratch``, and within a
    sequence different ``(h, j)`` own disjoint columns. So no two programs write the same element, and a
    program reads back only scratch elements it wrote itself (module docstring, points 1-4)."""
    nb, n, n_v_heads, dim_v = v.shape
    dim_k = q.shape[-1]
    out = torch.empty(nb, n, n_v_heads, dim_v, dtype=v.dtype, device=v.device)
    if n == 0 or out.numel() == 0 or dim_k == 0:
        if out.numel() and dim_k == 0:
            out.zero_()
        return out
    chain = parents is None
    if store_states == "branches":
        mode = STORE_NONE if chain else STORE_FLAGGED  # a chain reloads nothing
    else:
        mode = STORE_ALL if (scratch is not None or not chain) else STORE_NONE
    if mode != STORE_NONE and scratch is None:
        scratch = torch.empty(nb, n, n_v_heads, dim_k, dim_v, dtype=torch.float32, device=v.device)
    # Pointers a mode never reads get ``state`` as a stand-in (one fp32 signature per mode), with stride 0.
    flags = _branch_flags(parents, n) if mode == STORE_FLAGGED else state
    scratch_arg = scratch if mode != STORE_NONE else state
    xs = scratch_arg.stride() if mode != STORE_NONE else (0, 0, 0, 0, 0)
    cfg = state_config(dim_k, dim_v)
    grid = (n_v_heads, triton.cdiv(dim_v, cfg["BV"]), nb)
    _gated_delta_tree_kernel[grid](
        q, k, v, g, beta, state, parents if parents is not None else state, flags, out, scratch_arg,
        n, n_v_heads // q.shape[2], dim_k, dim_v, float(dim_k ** -0.5 if scale is None else scale),
        *q.stride(), *k.stride(), *v.stride(), *g.stride(), *beta.stride(), *state.stride(),
        parents.stride(0) if parents is not None else 0, flags.stride(0) if mode == STORE_FLAGGED else 0,
        *out.stride(), *xs,
        CHAIN=chain, STORE=mode, QK_L2NORM=bool(qk_l2norm), BK=cfg["BK"], BV=cfg["BV"],
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    return out


def gated_delta_tree(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                     state: torch.Tensor, parents: Optional[torch.Tensor] = None, *, scale: Optional[float] = None,
                     qk_l2norm: bool = True, scratch: Optional[torch.Tensor] = None, store_states: str = "all",
                     check: bool = False) -> torch.Tensor:
    """Gated-delta outputs of every node of a tree (a chain when ``parents`` is None), for one sequence or a batch.

    Node ``i`` starts from its parent's state (``state`` when ``parents[i] ==
    -1``); see the module docstring for the recurrence. A batch of ``b``
    sequences (every tensor with a leading ``[b]``) runs ``b`` independent
    trees of the same node count in one launch, each from its own state.

    Args:
        q, k: ``[N, Hk, Dk]`` (a batch: ``[b, N, Hk, Dk]``); v: ``[N, Hv, Dv]`` (``[b, N, Hv, Dv]``); any float
            dtype and strides; ``Hv % Hk == 0``.
        g: ``[N, Hv]`` (``[b, N, Hv]``) log-decay (float, used in fp32); beta: likewise, float.
        state: fp32 ``[Hv, Dk, Dv]`` (``[b, Hv, Dk, Dv]``), the committed state (not modified).
        parents: ``[N]`` (``[b, N]``: each sequence's tree) int64/int32 on the inputs' device, ``parents[..., i]``
            in ``[-1, i)``; None: the chain ``-1, 0, ..., N-2`` (no state traffic at all).
        scale: query scale (default ``Dk ** -0.5``, as transformers).
        qk_l2norm: l2-normalize q and k first (fp32, eps 1e-6), as ``use_qk_l2norm_in_kernel=True``.
        scratch: optional fp32 ``[>= N, Hv, Dk, Dv]`` (``[b, >= N, Hv, Dk, Dv]``) buffer (reuse one across
            layers). When given, ``scratch[..., i, :, :, :]`` receives node ``i``'s state (chain too); when None
            a tree gets an internal one.
        store_states: ``"all"`` (every node's state is stored in the scratch) or ``"branches"`` (the Triton
            kernel stores only the states a later node reloads and leaves the other scratch rows unwritten:
            use it when the commit replays the path; the reference writes every row either way).
        check: True also validates the parents' values (reads them on the host: a sync on a GPU).

    Returns:
        ``[N, Hv, Dv]`` (``[b, N, Hv, Dv]``) in ``v.dtype``: ``o_i = S_i^T (scale * q_i)``.
    """
    op = "gated_delta_tree"
    _require_tensor(op, "q", q)
    lead = tuple(q.shape[:1]) if q.dim() == 4 else ()
    n, n_k_heads, n_v_heads, dim_k, dim_v = _check_qkv(op, q, k, v, g, beta, lead, "batch")
    _check_state(op, state, lead + (n_v_heads, dim_k, dim_v), q.device)
    _check_scale(op, scale)
    if store_states not in STORE_STATES:
        raise ValueError(f"{op}: store_states must be one of {STORE_STATES}, got {store_states!r}")
    if parents is not None:
        _require_index(op, "parents", parents, q.device, [lead + (n,)])
        if check:
            _check_parent_values(op, parents, n)
    if scratch is not None:
        _require_tensor(op, "scratch", scratch)
        nl = len(lead)
        if (scratch.dtype != torch.float32 or scratch.dim() != 4 + nl or tuple(scratch.shape[:nl]) != lead
                or scratch.shape[nl] < n or tuple(scratch.shape[nl + 1:]) != (n_v_heads, dim_k, dim_v)):
            want = [*lead, f">= {n}", n_v_heads, dim_k, dim_v]
            raise ValueError(f"{op}: scratch must be float32 [{', '.join(map(str, want))}], got "
                             f"{scratch.dtype} {list(scratch.shape)}")
        if scratch.device != q.device:
            raise ValueError(f"{op}: scratch is on {scratch.device} but q is on {q.device}")

    def triton_path():
        if lead:
            return _tree_triton(q, k, v, g, beta, state, parents, scale, qk_l2norm, scratch, store_states)
        one = lambda t: None if t is None else t[None]  # noqa: E731  (one sequence: a batch of 1)
        return _tree_triton(q[None], k[None], v[None], g[None], beta[None], state[None], one(parents), scale,
                            qk_l2norm, one(scratch), store_states)[0]

    return dispatch(
        None, q.device, triton=triton_path,
        traced=lambda: torch.ops.dflash.gated_delta_tree(q, k, v, g, beta, state, parents, scratch, scale,
                                                         qk_l2norm, store_states, False),
        reference=lambda: _reference.gated_delta_tree(q, k, v, g, beta, state, parents, scale=scale,
                                                      qk_l2norm=qk_l2norm, scratch=scratch))


@declare("gated_delta_tree", mutates={"scratch"}, fake=lambda a: a.v.new_empty(a.v.shape))
def _gated_delta_tree_op(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor,
                         parents: Optional[Tensor], scratch: Optional[Tensor], scale: Optional[float] = None,
                         qk_l2norm: bool = True, store_states: str = "all", check: bool = False) -> Tensor:
    """:func:`gated_delta_tree`: ``[N, Hv, Dv]`` outputs in ``v``'s dtype (``scratch`` written).

    ``parents`` and ``scratch`` are required (either may be None): a mutated argument must always be
    passed, since torch before 2.13 bumps its version counter by position and fails on a defaulted one."""
    return gated_delta_tree(q, k, v, g, beta, state, parents, scale=scale, qk_l2norm=qk_l2norm, scratch=scratch,
                            store_states=store_states, check=check)


# --------------------------------------------------------------------------- gated_delta_replay_


def _replay_triton(state, k, v, g, beta, rows, num_rows, qk_l2norm):
    """The launch over layers and a batch: ``state [L, b, Hv, Dk, Dv]``, ``k [L, b, N, Hk, Dk]``, ``v [L, b, N,
    Hv, Dv]``, ``g, beta [L, b, N, Hv]``, ``rows [b, A]`` (any strides: a shared ``[A]`` expanded with stride 0),
    ``num_rows [b]`` (or ``[1]``, read by every sequence).

    Grid ``(L * b, Hv, cdiv(Dv, BV))``: program ``(l * b + r, h, j)`` loads and stores only ``state[l, r, h, :,
    j-block]``; distinct programs have distinct ``(l, r, h, j)``, hence disjoint slices of ``state`` (``state``
    must not alias itself: a contiguous or sliced buffer). Everything else is read only."""
    n_layers, nb, n_v_heads, dim_k, dim_v = state.shape
    if state.numel() == 0 or rows.shape[-1] == 0 or k.shape[2] == 0:
        return
    cfg = state_config(dim_k, dim_v)
    grid = (n_layers * nb, n_v_heads, triton.cdiv(dim_v, cfg["BV"]))
    counts = num_rows.reshape(-1)
    _gated_delta_replay_kernel[grid](
        state, k, v, g, beta, rows, counts,
        rows.shape[-1], nb, n_v_heads // k.shape[3], dim_k, dim_v,
        *state.stride(), *k.stride(), *v.stride(), *g.stride(), *beta.stride(),
        rows.stride(0), counts.stride(0) if counts.numel() > 1 else 0,
        QK_L2NORM=bool(qk_l2norm), BK=cfg["BK"], BV=cfg["BV"],
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )


def gated_delta_replay_(state: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                        beta: torch.Tensor, rows: torch.Tensor, num_rows: torch.Tensor, *,
                        scale: Optional[float] = None, qk_l2norm: bool = True, check: bool = False) -> None:
    """Advance ``state`` IN PLACE through the chain of rows ``rows[0], ..., rows[n-1]``, ``n = clamp(num_rows, 0, A)``.

    The commit of a verify: the state after exactly the accepted path, from
    the pre-verify state and the verify pass's per-row inputs. One launch;
    the count is read on the device (no host sync, fixed shapes). A batch
    (``state [L, b, Hv, Dk, Dv]``) advances each sequence ``r`` through its own
    ``rows[r, :num_rows[r]]`` (a count of 0 leaves its state as it is).

    Args:
        state: fp32 ``[Hv, Dk, Dv]``, ``[L, Hv, Dk, Dv]`` for ``L`` layers in one launch, or ``[L, b, Hv, Dk,
            Dv]`` for ``L`` layers of a batch of ``b`` sequences (any strides).
        q, k: ``[*lead, N, Hk, Dk]``; v ``[*lead, N, Hv, Dv]``; g, beta ``[*lead, N, Hv]`` (``lead`` the state's
            leading dims ``()``, ``[L]`` or ``[L, b]``): the verify pass's inputs, any float dtype.
        rows: ``[A]`` int64/int32 on the state's device: row indices into ``N`` (the accepted path, in order;
            the same for every layer, and for every sequence of a batch), or ``[b, A]`` (each sequence's; a
            batch only); entries past ``n`` are never read.
        num_rows: ``[1]`` or ``[]`` int64/int32 on the state's device; a batch may pass ``[b]`` (one per
            sequence).
        scale, qk_l2norm: as :func:`gated_delta_tree` (q is not needed for the state: it is validated only).
        check: True validates ``num_rows`` in ``[0, A]`` and ``rows[:n]`` in ``[0, N)`` (host read: a sync).
    """
    op = "gated_delta_replay_"
    _require_tensor(op, "state", state)
    if state.dim() not in (3, 4, 5):
        raise ValueError(f"{op}: state must be [Hv, Dk, Dv] or [L, Hv, Dk, Dv] (or [L, b, Hv, Dk, Dv] for a batch "
                         f"of b sequences), got {list(state.shape)}")
    lead = tuple(state.shape[:-3])
    n, n_k_heads, n_v_heads, dim_k, dim_v = _check_qkv(op, q, k, v, g, beta, lead)
    _check_state(op, state, lead + (n_v_heads, dim_k, dim_v), q.device)
    _check_scale(op, scale)
    batch = lead[1] if len(lead) == 2 else None
    _require_rows(op, rows, q.device, batch)
    _require_counts(op, num_rows, q.device, batch)
    if check:
        _check_rows_values(op, rows, num_rows, n)

    def triton_path():
        s, kk, vv, gg, bb = state, k, v, g, beta
        if len(lead) < 2:  # layers of one sequence, or one layer: a batch of 1 (of 1 layer)
            add = (lambda t: t[None, None]) if not lead else (lambda t: t[:, None])
            s, kk, vv, gg, bb = (add(t) for t in (s, kk, vv, gg, bb))
        nb = s.shape[1]
        _replay_triton(s, kk, vv, gg, bb, rows.expand(nb, -1) if rows.dim() == 1 else rows, num_rows, qk_l2norm)

    dispatch(None, state.device, triton=triton_path,
             traced=lambda: torch.ops.dflash.gated_delta_replay_(state, q, k, v, g, beta, rows, num_rows, scale,
                                                                 qk_l2norm, False),
             reference=lambda: _reference.gated_delta_replay_(state, q, k, v, g, beta, rows, num_rows, scale=scale,
                                                              qk_l2norm=qk_l2norm))
    return None


@declare("gated_delta_replay_", mutates={"state"}, fake=lambda a: None)
def _gated_delta_replay_op(state: Tensor, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, rows: Tensor,
                           num_rows: Tensor, scale: Optional[float] = None, qk_l2norm: bool = True,
                           check: bool = False) -> None:
    """:func:`gated_delta_replay_`: ``state`` advanced in place through the accepted rows."""
    gated_delta_replay_(state, q, k, v, g, beta, rows, num_rows, scale=scale, qk_l2norm=qk_l2norm, check=check)


# --------------------------------------------------------------------------- convolution


def _check_conv(op, x, window, weight, bias):
    for name, t in (("x", x), ("window", window), ("weight", weight)):
        _require_tensor(op, name, t)
        _require_float(op, name, t)
    if x.dim() not in (2, 3):
        raise ValueError(f"{op}: x must be [N, C] (or [b, N, C] for a batch), got {list(x.shape)}")
    lead = tuple(x.shape[:-2])
    channels = x.shape[-1]
    if weight.dim() != 2 or weight.shape[0] != channels or weight.shape[1] < 1:
        raise ValueError(f"{op}: weight must be [C, K] = [{channels}, K >= 1], got {list(weight.shape)}")
    km1 = weight.shape[1] - 1
    if tuple(window.shape) != lead + (km1, channels):
        want = list(lead) + [km1, channels]
        raise ValueError(f"{op}: window must be [{'b, ' if lead else ''}K-1, C] = {want}, got {list(window.shape)}")
    if window.dtype != x.dtype:
        raise ValueError(f"{op}: window must have x's dtype {x.dtype}, got {window.dtype}")
    if bias is not None:
        _require_tensor(op, "bias", bias)
        if tuple(bias.shape) != (channels,) or bias.dtype != weight.dtype:
            raise ValueError(f"{op}: bias must be [C] = [{channels}] of the weight's dtype {weight.dtype}, got "
                             f"{bias.dtype} {list(bias.shape)}")
    for name, t in (("window", window), ("weight", weight), ("bias", bias)):
        if t is not None and t.device != x.device:
            raise ValueError(f"{op}: {name} is on {t.device} but x is on {x.device}")
    return lead


def _conv_triton(x, window, weight, parents, bias, activation):
    """The launch over a batch: ``x [b, N, C]``, ``window [b, K-1, C]``, ``parents [b, N]`` or None -> ``[b, N, C]``.

    Grid ``(cdiv(N, BN), cdiv(C, BC), b)``: program ``(i, j, r)`` stores only ``y[r, i-block, j-block]``; the
    programs' blocks are disjoint, every other tensor is only read."""
    nb, n, channels = x.shape
    y = torch.empty(nb, n, channels, dtype=x.dtype, device=x.device)
    if y.numel() == 0:
        return y
    k = weight.shape[1]
    grid = (triton.cdiv(n, CONV_BLOCK_N), triton.cdiv(channels, CONV_BLOCK_C), nb)
    # A K = 1 conv has an empty window: pass x as a never-read stand-in with x's strides.
    win = window if k > 1 else x
    _causal_conv_tree_kernel[grid](
        x, win, weight, bias if bias is not None else weight, parents if parents is not None else x, y,
        n, channels, *x.stride(), *win.stride(), *weight.stride(), parents.stride(0) if parents is not None else 0,
        *y.stride(),
        K=k, CHAIN=parents is None, HAS_BIAS=bias is not None, SILU=activation == "silu",
        BN=CONV_BLOCK_N, BC=CONV_BLOCK_C, num_warps=CONV_NUM_WARPS, num_stages=1,
    )
    return y


def causal_conv_tree(x: torch.Tensor, window: torch.Tensor, weight: torch.Tensor,
                     parents: Optional[torch.Tensor] = None, *, bias: Optional[torch.Tensor] = None,
                     activation: Optional[str] = "silu", check: bool = False) -> torch.Tensor:
    """Depthwise causal conv over a tree: node ``i``'s taps are itself and its ``K-1`` nearest ancestors.

    ``y_i = act(sum_{m<K} weight[:, K-1-m] * x_{a_m(i)} + bias)`` with ``a_0 = i``,
    ``a_{m+1} = parent(a_m)``; past the root the chain continues into
    ``window`` most recent row first. Equals transformers'
    ``causal_conv1d_update`` run along the root -> node path. A batch (every
    tensor but the weight and bias with a leading ``[b]``) convolves each
    sequence's tree over its own window.

    Args:
        x: ``[N, C]`` (``[b, N, C]``) float; window: ``[K-1, C]`` (``[b, K-1, C]``) of ``x``'s dtype, rows oldest
            first.
        weight: ``[C, K]`` (the conv1d weight squeezed); bias: ``[C]`` of its dtype, or None.
        parents: ``[N]`` (``[b, N]``) int on x's device, ``parents[..., i]`` in ``[-1, i)``; None: the chain.
        activation: ``"silu"`` or None.
        check: True also validates the parents' values (host read).

    Returns:
        ``[N, C]`` (``[b, N, C]``) in ``x.dtype`` (computed in the weight's dtype, as transformers).
    """
    op = "causal_conv_tree"
    lead = _check_conv(op, x, window, weight, bias)
    if activation not in ACTIVATIONS:
        raise ValueError(f"{op}: activation must be 'silu' or None, got {activation!r}")
    n = x.shape[-2]
    if parents is not None:
        _require_index(op, "parents", parents, x.device, [lead + (n,)])
        if check:
            _check_parent_values(op, parents, n)

    def triton_path():
        if lead:
            return _conv_triton(x, window, weight, parents, bias, activation)
        return _conv_triton(x[None], window[None], weight, None if parents is None else parents[None], bias,
                            activation)[0]

    return dispatch(
        None, x.device, triton=triton_path,
        traced=lambda: torch.ops.dflash.causal_conv_tree(x, window, weight, parents, bias, activation, False),
        reference=lambda: _reference.causal_conv_tree(x, window, weight, parents, bias=bias, activation=activation))


@declare("causal_conv_tree", fake=lambda a: a.x.new_empty(a.x.shape))
def _causal_conv_tree_op(x: Tensor, window: Tensor, weight: Tensor, parents: Optional[Tensor] = None,
                         bias: Optional[Tensor] = None, activation: Optional[str] = "silu",
                         check: bool = False) -> Tensor:
    """:func:`causal_conv_tree`: ``[N, C]`` in ``x``'s dtype."""
    return causal_conv_tree(x, window, weight, parents, bias=bias, activation=activation, check=check)


def conv_window_after(window: torch.Tensor, x: torch.Tensor, rows: torch.Tensor,
                      num_rows: torch.Tensor) -> torch.Tensor:
    """The last ``K-1`` rows of ``concat(window, x[rows[:n]])``, ``n = clamp(num_rows, 0, A)``: the committed window.

    Args:
        window: ``[K-1, C]``, ``[L, K-1, C]``, or ``[L, b, K-1, C]`` (``L`` layers of ``b`` sequences), oldest row
            first.
        x: ``[N, C]`` (``[L, N, C]``, ``[L, b, N, C]``): the verify pass's conv inputs, ``window``'s dtype.
        rows: ``[A]`` int on the device (the accepted rows in order; the same for every layer and sequence),
            or ``[b, A]`` (each sequence's; a batch only).
        num_rows: ``[1]`` / ``[]`` int on the device; a batch may pass ``[b]`` (one per sequence).

    Returns:
        a new tensor of ``window``'s shape. Torch index math on every backend
        (gathers and a select: there is nothing to fuse); no host read.
    """
    op = "conv_window_after"
    for name, t in (("window", window), ("x", x)):
        _require_tensor(op, name, t)
    if window.dim() not in (2, 3, 4) or x.dim() != window.dim():
        raise ValueError(f"{op}: window and x must be [K-1, C] and [N, C] (or [L, K-1, C] and [L, N, C], or "
                         f"[L, b, K-1, C] and [L, b, N, C]), got {list(window.shape)} and {list(x.shape)}")
    if window.shape[-1] != x.shape[-1] or window.shape[:-2] != x.shape[:-2]:
        raise ValueError(f"{op}: window {list(window.shape)} and x {list(x.shape)} disagree on C or L (or b)")
    if window.dtype != x.dtype:
        raise ValueError(f"{op}: x must have window's dtype {window.dtype}, got {x.dtype}")
    if x.device != window.device:
        raise ValueError(f"{op}: x is on {x.device} but window is on {window.device}")
    batch = window.shape[1] if window.dim() == 4 else None
    _require_rows(op, rows, window.device, batch)
    _require_counts(op, num_rows, window.device, batch)
    return _reference.conv_window_after(window, x, rows, num_rows)


@declare("conv_window_after", fake=lambda a: a.window.new_empty(a.window.shape))
def _conv_window_after_op(window: Tensor, x: Tensor, rows: Tensor, num_rows: Tensor) -> Tensor:
    """:func:`conv_window_after`: a new ``[K-1, C]`` (``[L, K-1, C]``) window."""
    return conv_window_after(window, x, rows, num_rows)


# --------------------------------------------------------------------------- compile-test enumeration

#: Qwen3.5 linear-attention shapes ``(name, Hk, Hv, Dk, Dv, conv K)``: 27B and 9B.
QWEN35_SHAPES = (("27B", 16, 48, 128, 128, 4), ("9B", 16, 32, 128, 128, 4))


def launch_configs(shapes=QWEN35_SHAPES, dtypes=(torch.bfloat16, torch.float32), n_nodes: int = 65,
                   n_layers: int = 48, batch: int = 4, path_rows: int = 17) -> List[dict]:
    """Every binary the launchers pick at these shapes (for the sm_90 / sm_80 compile test).

    Each entry: ``name``, ``kernel``, ``signature``, ``constexprs``, ``num_warps``, ``num_stages``,
    ``divisible_by_16``. Integer arguments are specialized as the Triton runtime does for the
    real layout of a batch of ``batch`` sequences: q / k / v are views of the conv output ``[b, N,
    C]`` (row stride ``C``), ``g`` / ``beta`` / ``out`` / ``state`` / ``scratch`` / ``parents``
    contiguous, the replay's rows per sequence ``[b, path_rows]``; unit strides become constexprs,
    multiples of 16 get the divisibility hint, the counts are ``do_not_specialize``.
    """
    from .gather import runtime_int_specialization

    out, seen = [], set()

    def add(name, kernel, ptrs, ints, dns, constexprs, cfg):
        types, divisible, ones = runtime_int_specialization(ints, dns)
        signature = dict(ptrs, **types)
        consts = dict(constexprs, **ones)
        key = (kernel.fn.__name__ if hasattr(kernel, "fn") else name, tuple(sorted(signature.items())),
               tuple(sorted(consts.items())), tuple(divisible))
        if key in seen:
            return
        seen.add(key)
        out.append(dict(name=name, kernel=kernel, signature=signature, constexprs=consts,
                        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], divisible_by_16=divisible))

    for shape_name, hk, hv, dk, dv, kconv in shapes:
        channels = 2 * hk * dk + hv * dv
        cfg = state_config(dk, dv)
        for dtype in dtypes:
            t = "*" + _TRITON_TYPE[dtype]
            qkv = {"q_ptr": t, "k_ptr": t, "v_ptr": t, "g_ptr": "*fp32", "beta_ptr": t}
            tree_ints = {
                "n_nodes": n_nodes, "group": hv // hk, "dim_k": dk, "dim_v": dv,
                "stride_qb": n_nodes * channels, "stride_qn": channels, "stride_qh": dk, "stride_qd": 1,
                "stride_kb": n_nodes * channels, "stride_kn": channels, "stride_kh": dk, "stride_kd": 1,
                "stride_vb": n_nodes * channels, "stride_vn": channels, "stride_vh": dv, "stride_vd": 1,
                "stride_gb": n_nodes * hv, "stride_gn": hv, "stride_gh": 1,
                "stride_bb": n_nodes * hv, "stride_bn": hv, "stride_bh": 1,
                "stride_sb": hv * dk * dv, "stride_sh": dk * dv, "stride_sk": dv, "stride_sv": 1,
                "stride_pb": n_nodes, "stride_fb": n_nodes,
                "stride_ob": n_nodes * hv * dv, "stride_on": hv * dv, "stride_oh": dv, "stride_od": 1,
                "stride_xb": n_nodes * hv * dk * dv, "stride_xn": hv * dk * dv, "stride_xh": dk * dv,
                "stride_xk": dv, "stride_xv": 1,
            }
            for chain, store in ((True, STORE_NONE), (True, STORE_ALL), (False, STORE_ALL), (False, STORE_FLAGGED)):
                # never-read pointers get ``state`` (fp32) as their stand-in, as the launcher passes them
                ptrs = dict(qkv, state_ptr="*fp32", parents_ptr="*fp32" if chain else "*i64",
                            flags_ptr="*i32" if store == STORE_FLAGGED else "*fp32", out_ptr=t,
                            scratch_ptr="*fp32", scale="fp32")
                ints = dict(tree_ints)
                if chain:  # no parents: stride 0 (the launcher's stand-in)
                    ints.update(stride_pb=0)
                if store != STORE_FLAGGED:
                    ints.update(stride_fb=0)
                if store == STORE_NONE:
                    ints.update(stride_xb=0, stride_xn=0, stride_xh=0, stride_xk=0, stride_xv=0)
                add(f"gated_delta_tree[{shape_name} {_TRITON_TYPE[dtype]} chain={chain} store={store}]",
                    _gated_delta_tree_kernel, ptrs, ints, TREE_DYNAMIC_INTS,
                    dict(CHAIN=chain, STORE=store, QK_L2NORM=True, BK=cfg["BK"], BV=cfg["BV"]), cfg)
            replay_ints = {"n_rows": path_rows, "n_batch": batch, "group": hv // hk, "dim_k": dk, "dim_v": dv,
                           "stride_sl": batch * hv * dk * dv, "stride_sb": hv * dk * dv, "stride_sh": dk * dv,
                           "stride_sk": dv, "stride_sv": 1}
            for p, dd in (("k", dk), ("v", dv)):
                replay_ints.update({f"stride_{p}l": batch * n_nodes * channels, f"stride_{p}b": n_nodes * channels,
                                    f"stride_{p}n": channels, f"stride_{p}h": dd, f"stride_{p}d": 1})
            for p in ("g", "b"):
                replay_ints.update({f"stride_{p}l": batch * n_nodes * hv, f"stride_{p}b": n_nodes * hv,
                                    f"stride_{p}n": hv, f"stride_{p}h": 1})
            replay_ints.update(stride_rb=path_rows, stride_cb=1)
            ptrs = {"state_ptr": "*fp32", "k_ptr": t, "v_ptr": t, "g_ptr": "*fp32", "beta_ptr": t,
                    "rows_ptr": "*i64", "count_ptr": "*i64"}
            add(f"gated_delta_replay[{shape_name} {_TRITON_TYPE[dtype]} L{n_layers}]", _gated_delta_replay_kernel,
                ptrs, replay_ints, REPLAY_DYNAMIC_INTS, dict(QK_L2NORM=True, BK=cfg["BK"], BV=cfg["BV"]), cfg)
            conv_ints = {"n_nodes": n_nodes, "channels": channels,
                         "stride_xb": n_nodes * channels, "stride_xn": channels, "stride_xc": 1,
                         "stride_wb": (kconv - 1) * channels, "stride_wr": channels, "stride_wc": 1,
                         "stride_fc": kconv, "stride_fk": 1, "stride_pb": n_nodes,
                         "stride_yb": n_nodes * channels, "stride_yn": channels, "stride_yc": 1}
            conv_cfg = {"num_warps": CONV_NUM_WARPS, "num_stages": 1}
            for chain in (True, False):
                ptrs = {"x_ptr": t, "window_ptr": t, "weight_ptr": t, "bias_ptr": t,
                        "parents_ptr": t if chain else "*i64", "y_ptr": t}
                add(f"causal_conv_tree[{shape_name} {_TRITON_TYPE[dtype]} chain={chain}]", _causal_conv_tree_kernel,
                    ptrs, dict(conv_ints, stride_pb=0) if chain else conv_ints, CONV_DYNAMIC_INTS,
                    dict(K=kconv, CHAIN=chain, HAS_BIAS=False, SILU=True, BN=CONV_BLOCK_N, BC=CONV_BLOCK_C),
                    conv_cfg)
    return out
