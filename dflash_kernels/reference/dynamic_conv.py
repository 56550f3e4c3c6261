"""Grouped dynamic causal convolution along a block (the DFlash2 drafter's conv), in pure torch.

Shapes: ``nb`` blocks of ``B`` rows, ``H`` channels in ``G`` groups of ``g =
H / G`` channels, ``K`` taps (``1 <= K <= B``)::

    x        [nb, B, H]      the block rows (any strides)
    dynamic  [nb, B, K, G]   per-position, per-group kernels (any strides: e.g. the
                             projection output [nb, B, 2, K, G] sliced at [:, :, 0] or [:, :, 1])
    base     [K, H]          the static kernel
    residual [nb, B, H]      optional

    w[b, t, o, c] = base[o, c] + dynamic[b, t, o, c // g]
    y[b, t, c]    = residual[b, t, c] + sum_{o < K, o <= t} w[b, t, o, c] * x[b, t - o, c]

Causal along the block only: output row ``t`` reads rows ``t, t-1, ...,
t-K+1`` of its own block; nothing crosses a block boundary. The sum runs in
fp32 (every input upcast; fp64 inputs in fp64) and is stored once in ``x``'s dtype (``residual +
conv`` rounded once). Gradients: :func:`dynamic_conv_backward`, the same math
as torch's autograd through :func:`dynamic_conv`, written out so that a fast
forward can use it.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

__all__ = ["check_dynamic_conv", "dynamic_conv", "dynamic_conv_backward"]

_FLOATS = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def check_dynamic_conv(x, dynamic, base, residual=None, who: str = "dynamic_conv") -> Tuple[int, int, int, int, int]:
    """Validate the shapes, dtypes and devices of :func:`dynamic_conv`'s inputs (no tensor values read).

    Returns ``(nb, B, H, K, G)``. Errors say what is wrong and what is allowed.
    """
    for name, t in (("x", x), ("dynamic", dynamic), ("base", base)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{who}: {name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype not in _FLOATS:
            raise ValueError(f"{who}: {name} must be float32, bfloat16, float16 or float64, got {t.dtype}")
    if x.dim() != 3:
        raise ValueError(f"{who}: x must be [nb, B, H] (blocks, block rows, channels), got shape {tuple(x.shape)}")
    nb, B, H = x.shape
    if dynamic.dim() != 4 or tuple(dynamic.shape[:2]) != (nb, B):
        raise ValueError(f"{who}: dynamic must be [nb, B, K, G] = [{nb}, {B}, K, G] (per-position kernels of x), "
                         f"got shape {tuple(dynamic.shape)}")
    K, G = dynamic.shape[2], dynamic.shape[3]
    if K < 1 or G < 1:
        raise ValueError(f"{who}: dynamic must have K >= 1 taps and G >= 1 groups, got shape {tuple(dynamic.shape)}")
    if H % G:
        raise ValueError(f"{who}: the {G} groups of dynamic must divide the {H} channels of x (group size H / G "
                         f"must be an integer)")
    if K > B:
        raise ValueError(f"{who}: {K} taps exceed the block of {B} rows (allowed: 1 <= K <= B)")
    if tuple(base.shape) != (K, H):
        raise ValueError(f"{who}: base must be [K, H] = [{K}, {H}], got shape {tuple(base.shape)}")
    if dynamic.dtype != x.dtype:
        raise ValueError(f"{who}: dynamic must have x's dtype {x.dtype}, got {dynamic.dtype}")
    for name, t in (("dynamic", dynamic), ("base", base)):
        if t.device != x.device:
            raise ValueError(f"{who}: {name} is on {t.device} but x is on {x.device}")
    if residual is not None:
        if not isinstance(residual, torch.Tensor):
            raise TypeError(f"{who}: residual must be a torch.Tensor or None, got {type(residual).__name__}")
        if residual.shape != x.shape or residual.dtype != x.dtype or residual.device != x.device:
            raise ValueError(f"{who}: residual must match x ({tuple(x.shape)}, {x.dtype}, {x.device}), got "
                             f"({tuple(residual.shape)}, {residual.dtype}, {residual.device})")
    return nb, B, H, K, G


def _shift(t: torch.Tensor, o: int) -> torch.Tensor:
    """``t[:, s - o]`` along dim 1 (zero for ``s < o``): the rows ``o`` taps back."""
    if o == 0:
        return t
    return torch.nn.functional.pad(t[:, : t.shape[1] - o], (0, 0, o, 0))


def _unshift(t: torch.Tensor, o: int) -> torch.Tensor:
    """``t[:, s + o]`` along dim 1 (zero past the end): the adjoint of :func:`_shift`."""
    if o == 0:
        return t
    return torch.nn.functional.pad(t[:, o:], (0, 0, 0, o))


def _tap(dynamic: torch.Tensor, base: torch.Tensor, o: int, g: int, dtype: torch.dtype) -> torch.Tensor:
    """``w[:, :, o, :] [nb, B, H]`` in ``dtype``: ``base[o] + dynamic[:, :, o]`` repeated over each group's
    channels."""
    return base[o].to(dtype) + dynamic[:, :, o].to(dtype).repeat_interleave(g, dim=-1)


def _work_dtype(x: torch.Tensor) -> torch.dtype:
    """fp32, or fp64 for fp64 inputs (the gradient checks)."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def dynamic_conv(x: torch.Tensor, dynamic: torch.Tensor, base: torch.Tensor,
                 residual: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``[nb, B, H]`` in ``x``'s dtype: the module docstring's ``y`` (K tap products, accumulated in fp32)."""
    nb, B, H, K, G = check_dynamic_conv(x, dynamic, base, residual)
    work = _work_dtype(x)
    xf = x.to(work)
    acc = torch.zeros_like(xf) if residual is None else residual.to(work)
    for o in range(K):
        acc = acc + _tap(dynamic, base, o, H // G, work) * _shift(xf, o)
    return acc.to(x.dtype)


def dynamic_conv_backward(grad: torch.Tensor, x: torch.Tensor, dynamic: torch.Tensor, base: torch.Tensor,
                          needs=(True, True, True, True)):
    """Gradients ``(dx, ddynamic, dbase, dresidual)`` of ``sum(grad * dynamic_conv(x, dynamic, base, residual))``.

    ``grad [nb, B, H]``; each result in its input's dtype and shape (None where ``needs`` says so)::

        dx[b, s, c]        = sum_{o < K, s + o < B} w[b, s + o, o, c] * grad[b, s + o, c]
        ddynamic[b, t, o, j] = sum_{c in group j} grad[b, t, c] * x[b, t - o, c]   (0 for t < o)
        dbase[o, c]        = sum_{b, t >= o} grad[b, t, c] * x[b, t - o, c]
        dresidual          = grad
    """
    nb, B, H, K, G = check_dynamic_conv(x, dynamic, base, who="dynamic_conv_backward")
    g = H // G
    work = _work_dtype(x)
    gf, xf = grad.to(work), x.to(work)
    dx = torch.zeros_like(xf) if needs[0] else None
    dd = [] if needs[1] else None
    db = [] if needs[2] else None
    for o in range(K):
        if dx is not None:
            dx = dx + _unshift(_tap(dynamic, base, o, g, work) * gf, o)
        if dd is not None or db is not None:
            prod = gf * _shift(xf, o)
            if dd is not None:
                dd.append(prod.view(nb, B, G, g).sum(-1))
            if db is not None:
                db.append(prod.sum((0, 1)))
    return (None if dx is None else dx.to(x.dtype),
            None if dd is None else torch.stack(dd, dim=2).to(dynamic.dtype),
            None if db is None else torch.stack(db).to(base.dtype),
            grad.to(x.dtype) if len(needs) > 3 and needs[3] else None)
