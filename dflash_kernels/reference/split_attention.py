"""Attention of a pass that sees its whole committed prefix, without a mask over the prefix.

A pass of ``T`` rows after ``p`` committed keys (a prefill chunk, a DFlash
chain, a DDTree tree, over one sequence) sees every committed key and, among
its own ``T`` keys, ``j <= i`` (causal) or the tree's ancestors-or-self
(``bits``). With a ``[T, p + T]`` boolean mask, SDPA on the CPU converts the
mask to floats and adds it to every score tile: about twice the time of the
same attention without one, and up to three times for a few rows over a long
prefix. This op splits the keys instead:

* the prefix part ``o_p, l_p``: the ``T`` rows over the ``p`` committed keys,
  no mask (every one is visible);
* the own part ``o_c, l_c``: the ``T`` rows over their own keys, ``is_causal``
  (the top-left-aligned causal rule is exactly ``j <= i`` here), or with the
  tree's ``[T, T]`` additive mask;

each with its log-sum-exp ``l = log sum_k exp(q.k * scale)`` per row, merged as

    o = (exp(l_p - m) o_p + exp(l_c - m) o_c) / (exp(l_p - m) + exp(l_c - m)),   m = max(l_p, l_c)

(float32; the result in the query's dtype): the softmax over the union of the
two key sets. Row ``i`` always sees its own key, so ``l_c`` is finite; ``p >= 1``
makes ``l_p`` finite.

The log-sum-exp comes from ``aten._scaled_dot_product_flash_attention_for_cpu``
(the kernel SDPA itself dispatches to on the CPU; it takes GQA key/value heads
as they are, but one head dim for keys and values). Elsewhere, without that op, or with values narrower than
the keys (MiMo-V2-Flash), :func:`split_attention` is SDPA
with the ``[T, p + T]`` mask of :func:`~dflash_kernels.reference.tree_visibility`:
the same attention.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from .tree_attention import _tree_bits_visible, tree_visibility

__all__ = ["split_attention"]

_FLASH_CPU = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def split_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, prefix_len: int,
                    bits: Optional[torch.Tensor] = None, *, scale: Optional[float] = None) -> torch.Tensor:
    """``[1, Hq, T, D]`` attention of ``query [1, Hq, T, D]`` over ``key/value [1, Hkv, prefix_len + T, D]``
    (GQA: ``Hq % Hkv == 0``): every committed key, and own key ``j`` when ``j <= i`` (``bits=None``) or bit ``j``
    of ``bits[i]`` is set (``bits [T, >= ceil(T/32)]`` int32, the tree's ancestors-or-self, the diagonal set).

    On the CPU the prefix and the pass's own keys are two passes merged by their log-sum-exp (see the module
    docstring); elsewhere SDPA with the boolean mask. ``prefix_len = 0`` causal is plain causal SDPA.
    """
    T = query.shape[-2]
    p = int(prefix_len)
    if key.shape[-2] != p + T or value.shape[-2] != p + T:
        raise ValueError(f"split_attention: key/value must hold prefix_len + T = {p + T} rows, got "
                         f"{key.shape[-2]} and {value.shape[-2]}")
    if bits is None and (p == 0 or T == 1):  # causal from the top-left corner, or one row that sees every key
        return F.scaled_dot_product_attention(query, key, value, is_causal=p == 0 and T > 1, scale=scale,
                                              enable_gqa=True)
    if (query.device.type != "cpu" or _FLASH_CPU is None or query.dim() != 4 or p == 0
            or key.shape[-1] != value.shape[-1]):  # the CPU kernel takes one head dim for keys and values
        mask = tree_visibility(bits, p, T, device=query.device)
        return F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scale, enable_gqa=True)
    own_mask = None
    if bits is not None:  # the kernel takes an additive mask in the query's dtype
        own_mask = torch.zeros(T, T, dtype=query.dtype, device=query.device).masked_fill_(
            ~_tree_bits_visible(bits, T), float("-inf"))
    out_p, lse_p = _FLASH_CPU(query, key[..., :p, :], value[..., :p, :], 0.0, False, scale=scale)
    out_c, lse_c = _FLASH_CPU(query, key[..., p:, :], value[..., p:, :], 0.0, bits is None, attn_mask=own_mask,
                              scale=scale)
    m = torch.maximum(lse_p, lse_c)
    w_p = torch.exp(lse_p - m)[..., None]
    w_c = torch.exp(lse_c - m)[..., None]
    out = (out_p.float() * w_p + out_c.float() * w_c) / (w_p + w_c)
    return out.to(query.dtype)
