"""Grouped dynamic causal convolution along a block, in one Triton launch (the DFlash2 drafter's conv).

Math and shapes: :mod:`dflash_kernels.reference.dynamic_conv`::

    y[b, t, c] = residual[b, t, c] + sum_{o < K, o <= t} (base[o, c] + dynamic[b, t, o, c // g]) * x[b, t - o, c]

A DFlash2 layer runs it twice around each sublayer: ``prepare`` convolves the
sublayer's input with the first half of the projected kernels, ``finish`` its
output with the second half, fused with the layer's residual add. The kernel
projection (one matmul) stays a cuBLAS GEMM; ``dynamic`` is read through its
strides, so the halves ``d[:, :, 0]`` / ``d[:, :, 1]`` of the projection's
``[nb, B, 2, K, G]`` output are never copied.

Kernel: grid ``(nb, cdiv(H, BLOCK_C))``; a program holds one block's
``[BLOCK_T >= B, BLOCK_C]`` tile of the output in fp32 registers and adds the
``K`` taps (``K`` a constexpr: the loop unrolls), each a shifted masked load of
``x`` (rows ``t - o < 0`` read as 0: nothing crosses a block start), one
``[BLOCK_C]`` row of ``base`` and the ``[BLOCK_T, BLOCK_C]`` gather of
``dynamic`` at group ``c // g``; then one store in ``x``'s dtype. Every input
element is read from global memory once per tap (the shifted re-reads hit
L1/L2); no shared memory, no atomics.

Autograd: calls that need gradients go through the custom op
``torch.ops.dflash.dynamic_conv`` (declared below), whose backward
is :func:`dynamic_conv_backward`: one more launch, a program per block and
channel tile again (:func:`_dynamic_conv_bwd_kernel`: ``dx`` from the rows ``o`` taps ahead,
``ddynamic`` as per-group sums of ``grad * x`` inside the tile, which holds
whole groups, and each block's share of ``dbase``, summed over blocks by one
torch reduction), for power-of-two group sizes up to 256; other group sizes
use the torch math of :func:`dflash_kernels.reference.dynamic_conv_backward`.
The reference backend differentiates through its own torch ops. fp64 inputs
run the reference on every backend (the kernels compute in fp32).
"""

from __future__ import annotations

from typing import List, Optional, Tuple

import torch
import triton
import triton.language as tl
from torch import Tensor

from . import reference as _reference
from ._declare import declare, dispatch
from ._dispatch import get_backend, resolve_backend
from .reference.dynamic_conv import check_dynamic_conv

__all__ = ["dynamic_conv"]

#: Channels per program.
BLOCK_C = 64
NUM_WARPS = 4

#: No kernel argument varies from call to call at a fixed model (the block count only sizes the grid).
DO_NOT_SPECIALIZE: tuple = ()

_TRITON_TYPE = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


@triton.jit
def _dynamic_conv_kernel(
    x_ptr, d_ptr, base_ptr, res_ptr, out_ptr,
    B, H, GROUP,  # block rows, channels, channels per group (g)
    stride_xn, stride_xt, stride_xc,
    stride_dn, stride_dt, stride_do, stride_dg,
    stride_bo, stride_bc,
    stride_rn, stride_rt, stride_rc,
    stride_on, stride_ot,  # out is a fresh contiguous [nb, B, H]: unit channel stride
    K: tl.constexpr, HAS_RESIDUAL: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr,
):
    """``out[n, t, c]`` for one block ``n`` and one channel tile: the module docstring's sum in fp32."""
    n = tl.program_id(0).to(tl.int64)
    offs_t = tl.arange(0, BLOCK_T)
    offs_c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    t_ok = offs_t < B
    c_ok = offs_c < H
    row_mask = t_ok[:, None] & c_ok[None, :]
    grp = offs_c // GROUP
    x_blk = x_ptr + n * stride_xn
    d_blk = d_ptr + n * stride_dn
    if HAS_RESIDUAL:
        acc = tl.load(res_ptr + n * stride_rn + offs_t[:, None] * stride_rt + offs_c[None, :] * stride_rc,
                      mask=row_mask, other=0.0).to(tl.float32)
    else:
        acc = tl.zeros((BLOCK_T, BLOCK_C), dtype=tl.float32)
    for o in tl.static_range(K):
        src = offs_t - o
        src_mask = (t_ok & (src >= 0))[:, None] & c_ok[None, :]
        xv = tl.load(x_blk + src[:, None] * stride_xt + offs_c[None, :] * stride_xc, mask=src_mask,
                     other=0.0).to(tl.float32)
        w = tl.load(d_blk + offs_t[:, None] * stride_dt + o * stride_do + grp[None, :] * stride_dg,
                    mask=row_mask, other=0.0).to(tl.float32)
        w += tl.load(base_ptr + o * stride_bo + offs_c * stride_bc, mask=c_ok, other=0.0).to(tl.float32)[None, :]
        acc += w * xv
    tl.store(out_ptr + n * stride_on + offs_t[:, None] * stride_ot + offs_c[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=row_mask)


@triton.jit
def _dynamic_conv_bwd_kernel(
    gy_ptr, x_ptr, d_ptr, base_ptr, dx_ptr, dd_ptr, db_ptr,
    B, H, G,
    stride_gn, stride_gt, stride_gc,
    stride_xn, stride_xt, stride_xc,
    stride_dn, stride_dt, stride_do, stride_dg,
    stride_bo, stride_bc,
    K: tl.constexpr, GROUP: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr,
):
    """Gradients of one block ``n``'s channel tile (``BLOCK_C`` a multiple of the group size ``GROUP``, so
    the tile holds whole groups). Writes, all fresh contiguous buffers:

    * ``dx [nb, B, H]`` (x's dtype): ``sum_o w[s + o, o, c] * gy[s + o, c]`` over ``s + o < B``;
    * ``dd [nb, B, K, G]`` fp32: ``sum_{c in group} gy[t, c] * x[t - o, c]``;
    * ``db [nb, K, H]`` fp32: this block's share of ``dbase``, ``sum_t gy[t, c] * x[t - o, c]``
      (summed over blocks by the launcher).
    """
    n = tl.program_id(0).to(tl.int64)
    pid_c = tl.program_id(1)
    offs_t = tl.arange(0, BLOCK_T)
    offs_c = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
    t_ok = offs_t < B
    c_ok = offs_c < H
    row_mask = t_ok[:, None] & c_ok[None, :]
    grp = offs_c // GROUP
    GPT: tl.constexpr = BLOCK_C // GROUP
    offs_g = pid_c * GPT + tl.arange(0, GPT)
    gy_blk = gy_ptr + n * stride_gn
    x_blk = x_ptr + n * stride_xn
    d_blk = d_ptr + n * stride_dn
    gy = tl.load(gy_blk + offs_t[:, None] * stride_gt + offs_c[None, :] * stride_gc, mask=row_mask,
                 other=0.0).to(tl.float32)
    dx = tl.zeros((BLOCK_T, BLOCK_C), dtype=tl.float32)
    for o in tl.static_range(K):
        # dx: the rows o taps ahead read this row through tap o
        ahead = offs_t + o
        a_mask = (ahead < B)[:, None] & c_ok[None, :]
        gya = tl.load(gy_blk + ahead[:, None] * stride_gt + offs_c[None, :] * stride_gc, mask=a_mask,
                      other=0.0).to(tl.float32)
        w = tl.load(d_blk + ahead[:, None] * stride_dt + o * stride_do + grp[None, :] * stride_dg, mask=a_mask,
                    other=0.0).to(tl.float32)
        w += tl.load(base_ptr + o * stride_bo + offs_c * stride_bc, mask=c_ok, other=0.0).to(tl.float32)[None, :]
        dx += w * gya
        # dd, db: this row's gradient times the input o taps back
        back = offs_t - o
        b_mask = (t_ok & (back >= 0))[:, None] & c_ok[None, :]
        xv = tl.load(x_blk + back[:, None] * stride_xt + offs_c[None, :] * stride_xc, mask=b_mask,
                     other=0.0).to(tl.float32)
        prod = gy * xv
        tl.store(db_ptr + (n * K + o) * H + offs_c, tl.sum(prod, axis=0), mask=c_ok)
        per_group = tl.sum(tl.reshape(prod, (BLOCK_T, GPT, GROUP)), axis=2)
        tl.store(dd_ptr + ((n * B + offs_t[:, None]) * K + o) * G + offs_g[None, :], per_group,
                 mask=t_ok[:, None] & (offs_g < G)[None, :])
    tl.store(dx_ptr + (n * B + offs_t[:, None]) * H + offs_c[None, :], dx.to(dx_ptr.dtype.element_ty),
             mask=row_mask)


#: Largest group size the Triton backward takes (a tile holds whole groups); larger ones, or group sizes that
#: are not powers of two, use the torch backward.
MAX_BWD_GROUP = 256


def backward_tile(group_size: int):
    """``(BLOCK_C, num_warps)`` of the backward: 64 channels, or one whole group when groups are wider (with
    8 warps from 128 channels: a [16, 128] fp32 tile of each of gy, dx and the products is 16 values a
    thread at 4 warps)."""
    block_c = max(BLOCK_C, int(group_size))
    return block_c, NUM_WARPS if block_c <= 64 else 8


def triton_backward_ok(H: int, G: int) -> bool:
    """Whether the Triton backward handles ``G`` groups of ``H`` channels (power-of-two group size <= 256)."""
    g = H // G
    return g <= MAX_BWD_GROUP and g & (g - 1) == 0


def _launch_backward(grad, x, dynamic, base):
    nb, B, H = x.shape
    K, G = dynamic.shape[2], dynamic.shape[3]
    g = H // G
    dev = x.device
    dx = torch.empty((nb, B, H), dtype=x.dtype, device=dev)
    dd = torch.empty((nb, B, K, G), dtype=torch.float32, device=dev)
    db = torch.empty((nb, K, H), dtype=torch.float32, device=dev)
    if dx.numel():
        block_c, warps = backward_tile(g)
        _dynamic_conv_bwd_kernel[(nb, triton.cdiv(H, block_c))](
            grad, x, dynamic, base, dx, dd, db, B, H, G,
            *grad.stride(), *x.stride(), *dynamic.stride(), *base.stride(),
            K=K, GROUP=g, BLOCK_T=block_t(B), BLOCK_C=block_c, num_warps=warps, num_stages=1,
        )
    return dx, dd.to(dynamic.dtype), db.sum(0).to(base.dtype)


def dynamic_conv_backward(grad: torch.Tensor, x: torch.Tensor, dynamic: torch.Tensor, base: torch.Tensor,
                          needs=(True, True, True, True), *, backend: Optional[str] = None):
    """``(dx, ddynamic, dbase, dresidual)`` of :func:`dflash_kernels.reference.dynamic_conv_backward`.

    On the Triton backend one launch computes all three input gradients (plus a sum of the per-block
    ``dbase`` shares) for power-of-two group sizes up to :data:`MAX_BWD_GROUP`; otherwise (and for fp64)
    the reference's torch ops. ``grad [nb, B, H]`` of x's dtype, any strides. None where ``needs`` says so.
    """
    nb, B, H, K, G = check_dynamic_conv(x, dynamic, base, who="dynamic_conv_backward")
    if grad.shape != x.shape or grad.device != x.device:
        raise ValueError(f"dynamic_conv_backward: grad must be [nb, B, H] = {list(x.shape)} on {x.device}, got "
                         f"{list(grad.shape)} on {grad.device}")
    which = resolve_backend(backend, x.device)
    if which == "reference" or x.dtype == torch.float64 or not triton_backward_ok(H, G):
        return _reference.dynamic_conv_backward(grad, x, dynamic, base, needs)
    dx, dd, db = _launch_backward(grad, x, dynamic, base)
    return (dx if needs[0] else None, dd if needs[1] else None, db if needs[2] else None,
            grad.to(x.dtype) if len(needs) > 3 and needs[3] else None)


def block_t(block_rows: int) -> int:
    """Row tile: the block size rounded up to a power of two (at least 2)."""
    return max(2, triton.next_power_of_2(int(block_rows)))


def _launch(x, dynamic, base, residual):
    nb, B, H = x.shape
    K, G = dynamic.shape[2], dynamic.shape[3]
    out = torch.empty((nb, B, H), dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out
    res = residual if residual is not None else x  # never read without HAS_RESIDUAL
    grid = (nb, triton.cdiv(H, BLOCK_C))
    _dynamic_conv_kernel[grid](
        x, dynamic, base, res, out, B, H, H // G,
        *x.stride(), *dynamic.stride(), *base.stride(), *res.stride(), out.stride(0), out.stride(1),
        K=K, HAS_RESIDUAL=residual is not None, BLOCK_T=block_t(B), BLOCK_C=BLOCK_C, num_warps=NUM_WARPS,
        num_stages=1,
    )
    return out


def _forward(x, dynamic, base, residual, backend: str):
    """The forward on ``backend`` (inputs checked; no autograd)."""
    if backend == "triton" and x.dtype != torch.float64:
        return _launch(x, dynamic, base, residual)
    return _reference.dynamic_conv(x, dynamic, base, residual)


def _needs_grad(*tensors) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def dynamic_conv(x: torch.Tensor, dynamic: torch.Tensor, base: torch.Tensor,
                 residual: Optional[torch.Tensor] = None, *, backend: Optional[str] = None) -> torch.Tensor:
    """``residual + conv(x, dynamic, base)``: the grouped dynamic causal conv along each block.

    Args:
        x: ``[nb, B, H]`` float (fp32 / bf16 / fp16; fp64 runs the reference), any strides.
        dynamic: ``[nb, B, K, G]`` of ``x``'s dtype, any strides (a slice of the projection output);
            ``G`` divides ``H``, ``1 <= K <= B``.
        base: ``[K, H]`` float.
        residual: ``[nb, B, H]`` like ``x``, or None.
        backend: 'triton' or 'reference' to fix the backend, None: :func:`dflash_kernels.get_backend`.

    Returns:
        a new contiguous ``[nb, B, H]`` in ``x``'s dtype (fp32 accumulation, one rounding).
        Differentiable with respect to every tensor argument on both backends.
    """
    check_dynamic_conv(x, dynamic, base, residual)
    reference = lambda: _reference.dynamic_conv(x, dynamic, base, residual)  # noqa: E731
    op = lambda: torch.ops.dflash.dynamic_conv(x, dynamic, base, residual)  # noqa: E731
    if x.dtype == torch.float64:  # fp64 runs the reference on every backend (a backend it names is still checked)
        resolve_backend(backend, x.device)
        return reference()
    # a call that needs gradients runs the custom op, whose autograd is the fused backward
    return dispatch(backend, x.device, reference=reference, traced=op,
                    triton=lambda: op() if _needs_grad(x, dynamic, base, residual) else _launch(x, dynamic, base,
                                                                                                 residual))


# --------------------------------------------------------------------------- registration
#
# ``dflash::dynamic_conv``: a new contiguous ``[nb, B, H]`` in ``x``'s dtype (``dynamic`` read through its
# strides), on :func:`dflash_kernels.get_backend` of x's device; its backward the op
# ``dflash::dynamic_conv_backward`` (one Triton launch, or the torch math of
# :func:`dflash_kernels.reference.dynamic_conv_backward`), so the Triton forward trains.


@declare("dynamic_conv_backward",
         fake=lambda a: tuple(t.new_empty(t.shape) for t in (a.x, a.dynamic, a.base)))
def _dynamic_conv_backward_op(grad: Tensor, x: Tensor, dynamic: Tensor,
                              base: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
    """:func:`dynamic_conv_backward`: ``(dx [nb, B, H], ddynamic [nb, B, K, G] (contiguous), dbase [K, H])`` in
    the inputs' dtypes (one Triton launch where the group size allows)."""
    dx, dd, db, _ = dynamic_conv_backward(grad, x, dynamic, base, (True, True, True, False),
                                          backend=get_backend(x.device))
    return dx, dd, db


def _dynamic_conv_setup_context(ctx, inputs, output):
    x, dynamic, base, residual = inputs
    ctx.save_for_backward(x, dynamic, base)
    ctx.has_residual = residual is not None


def _dynamic_conv_grad(ctx, grad):
    x, dynamic, base = ctx.saved_tensors
    dx, dd, db = torch.ops.dflash.dynamic_conv_backward(grad, x, dynamic, base)
    needs = ctx.needs_input_grad
    dres = grad.to(x.dtype) if ctx.has_residual and needs[3] else None
    return dx if needs[0] else None, dd if needs[1] else None, db if needs[2] else None, dres


@declare("dynamic_conv", fake=lambda a: a.x.new_empty(a.x.shape),
         autograd=(_dynamic_conv_grad, _dynamic_conv_setup_context))
def _dynamic_conv_op(x: Tensor, dynamic: Tensor, base: Tensor, residual: Optional[Tensor] = None) -> Tensor:
    """:func:`dynamic_conv`: ``residual + conv(x, dynamic, base)`` ``[nb, B, H]`` in x's dtype, on
    :func:`dflash_kernels.get_backend` of x's device."""
    return _forward(x.detach(), dynamic.detach(), base.detach(), None if residual is None else residual.detach(),
                    get_backend(x.device))


# --------------------------------------------------------------------------- compile-test enumeration

#: DFlash2 drafter shapes ``(name, H, B, K, g)``: hidden size, block size, taps, channels per group.
DFLASH2_SHAPES = (("H4096", 4096, 16, 4, 64), ("H2560", 2560, 16, 4, 32), ("H5120 K2", 5120, 16, 2, 128))


def launch_configs(shapes=DFLASH2_SHAPES, dtypes=(torch.bfloat16, torch.float32)) -> List[dict]:
    """Every binary :func:`dynamic_conv` launches at these shapes (for the sm_90 / sm_80 compile test).

    Each entry: ``name``, ``kernel``, ``signature``, ``constexprs``, ``num_warps``,
    ``num_stages``, ``divisible_by_16``. Integer arguments carry the Triton
    runtime's specialization for the model's layout: ``x`` / ``residual``
    contiguous ``[nb, B, H]`` (unit channel stride a constexpr), ``dynamic`` a
    half of the contiguous projection output ``[nb, B, 2, K, G]``, ``base`` a
    slice of the contiguous ``base_kernel [2, K, H]``; with and without the
    residual; and the backward kernel (the gradient contiguous, as autograd hands it).
    """
    from .gather import runtime_int_specialization

    out = []
    for shape_name, H, B, K, g in shapes:
        G = H // g
        ints = {"B": B, "H": H, "GROUP": g, "stride_xn": B * H, "stride_xt": H, "stride_xc": 1,
                "stride_dn": B * 2 * K * G, "stride_dt": 2 * K * G, "stride_do": G, "stride_dg": 1,
                "stride_bo": H, "stride_bc": 1, "stride_rn": B * H, "stride_rt": H, "stride_rc": 1,
                "stride_on": B * H, "stride_ot": H}
        types, divisible, ones = runtime_int_specialization(ints, DO_NOT_SPECIALIZE)
        bwd_ints = {"B": B, "H": H, "G": G, "stride_gn": B * H, "stride_gt": H, "stride_gc": 1,
                    **{k: v for k, v in ints.items() if k[:8] in ("stride_x", "stride_d", "stride_b")}}
        bwd_types, bwd_divisible, bwd_ones = runtime_int_specialization(bwd_ints, DO_NOT_SPECIALIZE)
        for dtype in dtypes:
            t = "*" + _TRITON_TYPE[dtype]
            out.append(dict(
                name=f"dynamic_conv_backward[{shape_name} {_TRITON_TYPE[dtype]}]", kernel=_dynamic_conv_bwd_kernel,
                signature=dict({"gy_ptr": t, "x_ptr": t, "d_ptr": t, "base_ptr": t, "dx_ptr": t, "dd_ptr": "*fp32",
                                "db_ptr": "*fp32"}, **bwd_types),
                constexprs=dict(dict(K=K, GROUP=g, BLOCK_T=block_t(B), BLOCK_C=backward_tile(g)[0]), **bwd_ones),
                num_warps=backward_tile(g)[1], num_stages=1, divisible_by_16=bwd_divisible))
            for has_res in (False, True):
                ptrs = {"x_ptr": t, "d_ptr": t, "base_ptr": t, "res_ptr": t, "out_ptr": t}
                out.append(dict(
                    name=f"dynamic_conv[{shape_name} {_TRITON_TYPE[dtype]} residual={has_res}]",
                    kernel=_dynamic_conv_kernel, signature=dict(ptrs, **types),
                    constexprs=dict(dict(K=K, HAS_RESIDUAL=has_res, BLOCK_T=block_t(B), BLOCK_C=BLOCK_C), **ones),
                    num_warps=NUM_WARPS, num_stages=1, divisible_by_16=divisible))
    return out
