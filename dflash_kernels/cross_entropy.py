"""The training loss at the head: fused linear cross-entropy over selected rows, never holding the ``[N, V]``
logits (as Liger-Kernel's fused linear cross entropy).

Shapes as :mod:`dflash_kernels.lm_head`: ``hidden [T, H]``, ``weight [V, H]``, ``norm_weight [H]`` (optional
final RMSNorm), ``positions [N]``, ``targets [N]`` int64, ``weights [N]`` (optional per-row loss weights). The
math is :func:`dflash_kernels.reference.lm_head_cross_entropy`: ``loss_r = w_r * (logsumexp(z_r) -
z_r[t_r])``, ``z = cap(rms_norm(hidden[positions]) @ weight.T)`` accumulated in fp32, 0 at ``ignore_index``.

Triton path: row chunks of at most ``chunk_elements`` fp32 logits (:func:`cross_entropy_chunk_plan`); per
chunk, the head's logits GEMM (:mod:`dflash_kernels.lm_head`'s ``_logits_kernel``, with its logsumexp
partials), then loss ``= lse - logit[target]`` and ``d loss / d a = (softmax - onehot) @ weight`` computed in
the forward (:func:`_ce_grad_kernel` writes ``scale * (softmax - onehot)`` in the dot dtype, times ``1 - (z /
c)^2`` under the final-logit softcap ``c``; then one GEMM), stored, and scaled by ``grad_output`` in backward.
Differentiable wrt ``hidden`` only (the weights are frozen). Under ``torch.compile`` the op is
``dflash::lm_head_cross_entropy`` with its own backward op (declared below).
"""

from __future__ import annotations

import math
from typing import Dict, List, Optional

import torch
import triton
import triton.language as tl

from torch import Tensor

from ._declare import declare, dispatch
from ._dispatch import triton_interpreting
from .lm_head import (DEFAULT_CHUNK_ELEMENTS, REAL_DTYPES, REAL_SHAPES, LaunchConfigs, _logits_chunk, _operand_a,
                      _rows, _TRITON_TYPE, dot_dtype_for, gemm_config, lm_head_logits)
from .reference import cross_entropy as _reference
from .reference.lm_head import HeadInputs, check_targets, head_inputs, rms_norm

__all__ = ["lm_head_cross_entropy"]


def ce_grad_config() -> Dict[str, int]:
    """BLOCK_R, BLOCK_V and num_warps of the softmax-minus-onehot kernel."""
    return dict(BLOCK_R=2, BLOCK_V=1024, num_warps=4)


#: Integer kernel arguments that vary from call to call (the chunk's row count and its first row):
#: ``do_not_specialize``, so a new chunk never selects a new binary.
DO_NOT_SPECIALIZE = {"_ce_grad_kernel": ("N", "row0")}


# --------------------------------------------------------------------------- kernel


# the chunk's row count and its first row vary from chunk to chunk
@triton.jit(do_not_specialize=DO_NOT_SPECIALIZE["_ce_grad_kernel"])
def _ce_grad_kernel(
    logits_ptr, stride_l,  # fp32 [N, V] chunk
    lse_ptr,  # fp32 [N] logsumexp per row
    target_ptr,  # int64 [row0 + N]: all rows' targets (the chunk's start at row0)
    scale_ptr,  # fp32 [row0 + N]: loss weight, 0 for ignored rows (same indexing)
    grad_ptr, stride_g,  # [N, V] in the dot dtype
    N, V, row0,
    softcap,  # HAS_SOFTCAP only
    BLOCK_R: tl.constexpr,
    BLOCK_V: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
):
    """grad[r, j] = scale[row0 + r] * (exp(logits[r, j] - lse[r]) - (j == target[row0 + r])), one tile.

    With HAS_SOFTCAP the logits are the capped ``y = c * tanh(x / c)`` of
    the raw ``x``, and the gradient wrt ``x`` gets ``dy/dx = 1 - (y / c)^2``.

    The tile is [BLOCK_R, BLOCK_V]; ``row0`` is an offset rather than a
    sliced pointer so that the chunk start never changes the pointer
    alignment the binary was specialized on.

    Overlap: ``logits``, ``lse``, ``target`` and ``scale`` are only read; the one store goes to ``grad``, a
    buffer of its own (:func:`_cross_entropy_forward` allocates it beside the logits chunk, never a view of
    an input), and program ``(i, j)`` writes only its own tile, rows ``[i*BLOCK_R, (i+1)*BLOCK_R)`` x columns
    ``[j*BLOCK_V, (j+1)*BLOCK_V)`` masked to ``N x V``: the tiles are disjoint, so no store meets another
    program's store or any load.
    """
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    r_mask = rows < N
    mask = r_mask[:, None] & (cols < V)[None, :]
    x = tl.load(logits_ptr + rows[:, None] * stride_l + cols[None, :], mask=mask, other=float("-inf"))
    lse = tl.load(lse_ptr + rows, mask=r_mask, other=0.0)
    target = tl.load(target_ptr + row0 + rows, mask=r_mask, other=-1)
    scale = tl.load(scale_ptr + row0 + rows, mask=r_mask, other=0.0)
    p = tl.exp(x - lse[:, None])
    g = (p - tl.where(cols[None, :] == target[:, None], 1.0, 0.0)) * scale[:, None]
    if HAS_SOFTCAP:
        t = tl.where(mask, x / softcap, 0.0)  # (masked lanes hold -inf)
        g = g * (1.0 - t * t)
    tl.store(grad_ptr + rows[:, None] * stride_g + cols[None, :], g.to(grad_ptr.dtype.element_ty), mask=mask)


# --------------------------------------------------------------------------- launchers


def cross_entropy_chunk_plan(n_rows: int, vocab: int, hidden: int, dot_dtype: torch.dtype = torch.bfloat16,
                             chunk_elements: Optional[int] = None) -> Dict[str, int]:
    """How the fused cross-entropy chunks ``n_rows`` positions, and the bytes its chunk buffers take.

    Returns ``rows_per_chunk``, ``logits_bytes`` (fp32 chunk), ``grad_bytes``
    (softmax - onehot chunk in the dot dtype), ``partial_bytes`` (logsumexp
    partials) and ``chunk_bytes`` (their sum: the largest transient buffer set
    the op allocates, besides its ``[N, H]`` operand and gradient).
    """
    budget = max(1, int(chunk_elements or DEFAULT_CHUNK_ELEMENTS))
    rows = max(1, min(n_rows, budget // vocab))
    if rows >= 128:
        rows = rows // 128 * 128
    elem = torch.empty((), dtype=dot_dtype).element_size()
    block_n = gemm_config(rows, dot_dtype)["BLOCK_N"]
    logits_bytes = rows * vocab * 4
    grad_bytes = rows * vocab * elem
    partial_bytes = 2 * rows * math.ceil(vocab / block_n) * 4
    return dict(rows_per_chunk=rows, logits_bytes=logits_bytes, grad_bytes=grad_bytes, partial_bytes=partial_bytes,
                chunk_bytes=logits_bytes + grad_bytes + partial_bytes)


def _grad_matmul(grad_logits: torch.Tensor, weight: torch.Tensor, out: torch.Tensor) -> None:
    """out = grad_logits @ weight ([n, V] @ [V, H]); upcasts weight chunk-wise when dtypes differ."""
    if grad_logits.dtype == weight.dtype:
        out.copy_(torch.mm(grad_logits, weight))
        return
    acc = torch.zeros(out.shape, dtype=torch.float32, device=out.device)
    step = max(1, (1 << 24) // max(1, weight.shape[1]))
    for v0 in range(0, weight.shape[0], step):
        acc += grad_logits[:, v0:v0 + step].float() @ weight[v0:v0 + step].float()
    out.copy_(acc)


def _cross_entropy_forward(a, weight, targets, scale, dot_dtype, need_grad, chunk_elements, softcap=None):
    """Per-row losses [N] and (if need_grad) d loss_r / d a_r [N, H], chunk by chunk (logits soft-capped
    with ``softcap``, the gradient through the cap)."""
    N, H = a.shape
    V = weight.shape[0]
    loss = torch.empty(N, dtype=torch.float32, device=a.device)
    grad_a = torch.empty_like(a) if need_grad else None
    if N == 0:
        return loss, grad_a
    plan = cross_entropy_chunk_plan(N, V, H, dot_dtype, chunk_elements)
    rows_per = plan["rows_per_chunk"]
    logits = torch.empty(min(rows_per, N), V, dtype=torch.float32, device=a.device)
    grad_logits = torch.empty(min(rows_per, N), V, dtype=dot_dtype, device=a.device) if need_grad else None
    safe_targets = targets.clamp(0, V - 1)  # ignored rows have scale 0
    cfg = dict(ce_grad_config())
    if triton_interpreting():  # fewer, larger programs (see _gemm_launch_args)
        cfg["BLOCK_R"] = 64
    for r0 in range(0, N, rows_per):
        r1 = min(N, r0 + rows_per)
        nr = r1 - r0
        chunk = logits[:nr]
        lse = _logits_chunk(a[r0:r1], weight, chunk, 0, V, dot_dtype, softcap)
        picked = chunk.gather(1, safe_targets[r0:r1, None]).squeeze(1)
        loss[r0:r1] = (lse - picked) * scale[r0:r1]
        if need_grad:
            g = grad_logits[:nr]
            _ce_grad_kernel[(triton.cdiv(nr, cfg["BLOCK_R"]), triton.cdiv(V, cfg["BLOCK_V"]))](
                chunk, chunk.stride(0), lse, targets, scale, g, g.stride(0), nr, V, r0,
                1.0 if softcap is None else float(softcap),
                BLOCK_R=cfg["BLOCK_R"], BLOCK_V=cfg["BLOCK_V"], HAS_SOFTCAP=softcap is not None,
                num_warps=cfg["num_warps"],
            )
            _grad_matmul(g, weight, grad_a[r0:r1])
    return loss, grad_a


class _FusedLinearCrossEntropy(torch.autograd.Function):
    """loss_r = scale_r * CE(cap(a_r @ W.T), t_r); the gradient wrt ``a`` is computed in the forward."""

    @staticmethod
    def forward(ctx, a, weight, targets, scale, dot_dtype, chunk_elements, softcap):
        loss, grad_a = _cross_entropy_forward(a.detach(), weight, targets, scale, dot_dtype,
                                              ctx.needs_input_grad[0], chunk_elements, softcap)
        if grad_a is not None:
            ctx.save_for_backward(grad_a)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        (grad_a,) = ctx.saved_tensors
        grad = (grad_a.float() * grad_loss.float()[:, None]).to(grad_a.dtype)
        return grad, None, None, None, None, None, None


def _cross_entropy_triton(head: HeadInputs, targets, weights, ignore_index, chunk_elements):
    hidden, norm_weight, eps, positions = head.hidden, head.norm_weight, head.eps, head.positions
    dot_dtype = dot_dtype_for(hidden.dtype, head.weight.dtype)
    weight = head.weight.detach()
    if weight.stride(1) != 1:
        weight = weight.contiguous()
    if torch.is_grad_enabled() and hidden.requires_grad:
        # Differentiable prologue in torch (autograd carries the gradient back
        # through the norm and the row gather); the fused op starts at ``a``.
        a = hidden if positions is None else hidden.index_select(0, positions)
        if norm_weight is not None:
            a = rms_norm(a, norm_weight.detach(), eps)
        a = a.to(dot_dtype)
        if a.stride(1) != 1:
            a = a.contiguous()
    else:
        a = _operand_a(head.detached(), dot_dtype)
    scale = (targets != ignore_index).float()
    if weights is not None:
        scale = scale * weights.detach().float()
    return _FusedLinearCrossEntropy.apply(a, weight, targets, scale.contiguous(), dot_dtype, chunk_elements,
                                          head.softcap)


# --------------------------------------------------------------------------- public op


def lm_head_cross_entropy(hidden, weight, targets, *, weights=None, norm_weight=None, eps=1e-6, positions=None,
                          ignore_index=-100, check_bounds=True, chunk_elements: Optional[int] = None,
                          softcap=None, backend=None) -> torch.Tensor:
    """fp32 ``[N]`` losses ``weights * (logsumexp(logits) - logits[target])`` (0 at ``ignore_index``).

    Differentiable wrt ``hidden`` only: ``weight`` and ``norm_weight`` are
    treated as frozen (no gradient). The Triton path never holds more than
    one row chunk of the logits (``chunk_elements`` fp32 values, default
    :data:`DEFAULT_CHUNK_ELEMENTS`); see :func:`cross_entropy_chunk_plan`.
    ``softcap``: None, or a finite float ``c > 0``, the final-logit softcap
    (Gemma 2 / 3's ``final_logit_softcapping``): logits become ``c * tanh(logits / c)``
    on the fp32 accumulator, before the loss; the gradient goes through the tanh
    (``d/dx = 1 - tanh^2``).

    ``backend``: 'triton' or 'reference' to fix the backend (a compiled round
    does), None: :func:`dflash_kernels.get_backend`.
    """
    head = head_inputs(hidden, weight, norm_weight, eps, positions, softcap, check_bounds=check_bounds)
    targets, weights = check_targets(targets, weights, head.rows, head.vocab, hidden.device, ignore_index)
    return dispatch(
        backend, hidden.device,
        reference=lambda: _reference.lm_head_cross_entropy(hidden, weight, targets, weights=weights,
                                                           norm_weight=norm_weight, eps=eps, positions=head.positions,
                                                           ignore_index=ignore_index, check_bounds=False,
                                                           softcap=head.softcap),
        traced=lambda: torch.ops.dflash.lm_head_cross_entropy(hidden, weight, targets, weights, norm_weight,
                                                              head.positions, eps, ignore_index, False,
                                                              chunk_elements, head.softcap),
        triton=lambda: _cross_entropy_triton(head, targets.contiguous(), weights, ignore_index, chunk_elements))


# --------------------------------------------------------------------------- registration
#
# ``dflash::lm_head_cross_entropy``: the forward only (fp32 ``[N]`` losses); its backward is the op
# ``dflash::lm_head_cross_entropy_backward`` (``register_autograd``): the gradient with respect to ``hidden``
# through the row gather and the final norm, ``weight`` / ``norm_weight`` / the loss ``weights`` frozen, as
# the public function's autograd does.


def _ce_grad_rows(grad_loss, head: HeadInputs, targets, weights, ignore_index, chunk_elements):
    """``d (sum_r grad_loss_r * loss_r) / d x`` for the selected rows ``x [N, H]`` (``head.hidden``, already
    gathered: ``head.positions`` is None; before the norm).

    Per row chunk (at most ``chunk_elements`` fp32 logits, the forward's bound): the capped fp32 logits
    ``z`` from :func:`dflash_kernels.lm_head_logits` (same backend as the forward), ``dz = g * w *
    (softmax(z) - onehot(t))`` (0 at ``ignore_index``), times ``1 - (z / c)^2`` under the softcap, then
    ``da = dz @ weight`` in fp32 (the reference's ``a.float() @ weight.float().T``, the weight upcast a few
    vocab rows at a time). Then back through HF's RMSNorm with its casts, exactly the steps autograd takes
    through :func:`dflash_kernels.reference.rms_norm`.
    """
    x, weight, norm_weight, eps, softcap = head.hidden, head.weight, head.norm_weight, head.eps, head.softcap
    n, h = x.shape
    vocab = weight.shape[0]
    grad_a = torch.zeros(n, h, dtype=torch.float32, device=x.device)
    if n > 0:
        scale = (targets != ignore_index).float() * grad_loss.float()
        if weights is not None:
            scale = scale * weights.detach().float()
        safe_targets = targets.clamp(0, vocab - 1)
        rows_per = max(1, min(n, int(chunk_elements or DEFAULT_CHUNK_ELEMENTS) // vocab))
        vocab_per = max(1, (1 << 24) // max(1, h))
        for r0 in range(0, n, rows_per):
            r1 = min(n, r0 + rows_per)
            z = lm_head_logits(x[r0:r1], weight, norm_weight=norm_weight, eps=eps, check_bounds=False,
                                   softcap=softcap)
            dz = torch.softmax(z, dim=-1)
            dz[torch.arange(r1 - r0, device=x.device), safe_targets[r0:r1]] -= 1.0
            dz *= scale[r0:r1, None]
            if softcap is not None:
                dz *= 1.0 - (z / softcap) ** 2
            for v0 in range(0, vocab, vocab_per):
                grad_a[r0:r1] += dz[:, v0:v0 + vocab_per] @ weight[v0:v0 + vocab_per].detach().float()
    grad_a = grad_a.to(x.dtype)  # the gradient of a.float() in a's dtype (a has x's dtype)
    if norm_weight is None:
        return grad_a
    nw = norm_weight.detach()
    # a = (nw * normed.to(x.dtype)).to(x.dtype): each cast's gradient is cast back to its input's dtype.
    grad_normed = (grad_a.to(torch.promote_types(nw.dtype, x.dtype)) * nw).to(x.dtype).float()
    xf = x.float()
    r = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    # normed = xf * r, r = (mean(xf^2) + eps)^-1/2:  d/dxf = r * g - xf * r^3 * mean(g * xf)
    grad_x = r * grad_normed - xf * r.pow(3) * (grad_normed * xf).mean(-1, keepdim=True)
    return grad_x.to(x.dtype)


@declare("lm_head_cross_entropy_backward", fake=lambda a: a.hidden.new_empty(a.hidden.shape))
def _lm_head_cross_entropy_backward_op(grad_loss: Tensor, hidden: Tensor, weight: Tensor, targets: Tensor,
                                       weights: Optional[Tensor] = None, norm_weight: Optional[Tensor] = None,
                                       positions: Optional[Tensor] = None, eps: float = 1e-6,
                                       ignore_index: int = -100, chunk_elements: Optional[int] = None,
                                       softcap: Optional[float] = None) -> Tensor:
    """Gradient of ``sum(grad_loss * lm_head_cross_entropy(hidden, ...))`` with respect to ``hidden``
    (``[T, H]``, hidden's dtype): recomputes the logits chunk by chunk (no ``[N, V]`` tensor kept from the
    forward), so a training step runs the lm_head GEMM three times where the public Triton path runs it
    twice (it computes the gradient inside the forward). Rows a position selects twice get both gradients."""
    targets = targets.to(torch.int64)
    pos = None if positions is None else positions.to(device=hidden.device, dtype=torch.int64)
    x = hidden.detach() if pos is None else hidden.detach().index_select(0, pos)
    head = HeadInputs(x, weight.detach(), norm_weight, eps, None, softcap)
    grad_x = _ce_grad_rows(grad_loss, head, targets, weights, ignore_index, chunk_elements)
    if pos is None:
        return grad_x.contiguous()
    return torch.zeros(hidden.shape, dtype=hidden.dtype, device=hidden.device).index_add_(0, pos, grad_x)


def _ce_setup_context(ctx, inputs, output):
    hidden, weight, targets, weights, norm_weight, positions, eps, ignore_index, _, chunk_elements, softcap = inputs
    ctx.save_for_backward(hidden, weight, targets, weights, norm_weight, positions)
    ctx.scalars = (eps, ignore_index, chunk_elements, softcap)


def _ce_backward(ctx, grad_loss):
    hidden, weight, targets, weights, norm_weight, positions = ctx.saved_tensors
    eps, ignore_index, chunk_elements, softcap = ctx.scalars
    grad_hidden = None
    if ctx.needs_input_grad[0]:
        grad_hidden = torch.ops.dflash.lm_head_cross_entropy_backward(
            grad_loss, hidden, weight, targets, weights, norm_weight, positions, eps, ignore_index,
            chunk_elements, softcap)
    return grad_hidden, None, None, None, None, None, None, None, None, None, None


@declare("lm_head_cross_entropy", fake=lambda a: a.hidden.new_empty(_rows(a), dtype=torch.float32),
         autograd=(_ce_backward, _ce_setup_context))
def _lm_head_cross_entropy_op(hidden: Tensor, weight: Tensor, targets: Tensor, weights: Optional[Tensor] = None,
                              norm_weight: Optional[Tensor] = None, positions: Optional[Tensor] = None,
                              eps: float = 1e-6, ignore_index: int = -100, check_bounds: bool = True,
                              chunk_elements: Optional[int] = None, softcap: Optional[float] = None) -> Tensor:
    """:func:`dflash_kernels.lm_head_cross_entropy`: fp32 ``[N]`` losses (the forward only; the backward is
    ``dflash::lm_head_cross_entropy_backward``, registered with ``register_autograd``)."""
    return lm_head_cross_entropy(hidden.detach(), weight.detach(), targets, weights=weights,
                                 norm_weight=norm_weight, eps=eps, positions=positions,
                                 ignore_index=ignore_index, check_bounds=check_bounds,
                                 chunk_elements=chunk_elements, softcap=softcap)


# --------------------------------------------------------------------------- compile enumeration


def launch_configs(shapes=REAL_SHAPES, dtypes=REAL_DTYPES) -> List[dict]:
    """Every distinct compiled variant of :func:`_ce_grad_kernel` for the given ``(H, V)`` shapes and ``(hidden
    dtype, weight dtype)`` pairs, with and without the final-logit softcap; entries as
    :func:`dflash_kernels.lm_head.launch_configs` (whose logits kernel the loss also runs)."""
    collect = LaunchConfigs(DO_NOT_SPECIALIZE)
    gcfg = ce_grad_config()
    for hidden_dtype, weight_dtype in dtypes:
        dt = _TRITON_TYPE[dot_dtype_for(hidden_dtype, weight_dtype)]
        for _, V in shapes:
            for softcap in (False, True):
                collect.add(f"ce_grad[{dt}{' softcap' if softcap else ''}]", _ce_grad_kernel,
                            {"logits_ptr": "*fp32", "lse_ptr": "*fp32", "target_ptr": "*i64", "scale_ptr": "*fp32",
                             "grad_ptr": "*" + dt, "softcap": "fp32"},
                            {"stride_l": V, "stride_g": V, "N": 16, "V": V, "row0": 0},
                            {"BLOCK_R": gcfg["BLOCK_R"], "BLOCK_V": gcfg["BLOCK_V"], "HAS_SOFTCAP": softcap},
                            gcfg["num_warps"], 1)
    return collect.out
