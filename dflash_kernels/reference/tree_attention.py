"""Pure-torch reference of the verification attention (SPEC sections 5 and 7.3).

T query tokens (the "tree": DDTree's root and nodes in pop order, a DFlash
chain, one AR token, a prefill chunk, or the drafter's block) attend over
``[prefix ; tree]`` keys, ``S = prefix_len + T``. Query ``i`` and tree key
``i`` are the same token. Visibility of key ``k`` to query ``i``:

* prefix key ``k < prefix_len``: always (subject to the window);
* tree key ``j = k - prefix_len``: bit ``j`` of ``bits[i]`` (ancestor-or-self
  bitmask of :func:`dflash_kernels.ancestor_bits`, or all ones for the
  drafter's non-causal block), or ``j <= i`` when ``bits is None`` (a causal
  chain);
* with a sliding ``window``: additionally hidden when
  ``pos_q(i) - pos_k(k) >= window``, where ``pos_q(i) = pos_k(prefix_len + i)
  = positions[i]`` (default ``prefix_len + i``) and prefix key ``k`` sits at
  position ``k``. A key at a later position than its query is never hidden by
  the window.

:func:`tree_visibility` is this rule in code; :func:`tree_attention` feeds it
to ``torch.nn.functional.scaled_dot_product_attention`` with GQA, or, with an
attention softcap or sinks (which SDPA cannot apply), computes the softmax
explicitly in float32 (:func:`_explicit_attention`).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

__all__ = ["tree_attention_mask", "tree_attention", "tree_visibility"]


def _tree_bits_visible(bits: torch.Tensor, n_tree: int) -> torch.Tensor:
    """``[T, T]`` bool: bit ``j % 32`` of ``bits[i, j // 32]``."""
    j = torch.arange(n_tree, device=bits.device)
    words = bits[:n_tree, j // 32].to(torch.int64) & 0xFFFFFFFF
    return ((words >> (j % 32)) & 1).bool()


def tree_visibility(
    bits: Optional[torch.Tensor],
    prefix_len: int,
    n_tree: int,
    positions: Optional[torch.Tensor] = None,
    window: Optional[int] = None,
    device=None,
) -> torch.Tensor:
    """Which keys each query sees: the spec of :func:`dflash_kernels.tree_attention`'s mask.

    Args:
        bits: ``[T, >= ceil(T/32)]`` int32 bitmask (tree key ``j`` visible to
            query ``i`` iff bit ``j`` of row ``i``), or None for a causal chain
            (``j <= i``).
        prefix_len: keys before the tree keys, ``>= 0``; prefix key ``k`` has position ``k``.
        n_tree: T, the number of query (= tree key) tokens.
        positions: ``[T]`` int absolute positions of the tree tokens, default
            ``prefix_len + arange(T)``; only used with ``window``.
        window: None, or an int ``>= 1``: also hide key ``k`` from query ``i``
            when ``pos_q(i) - pos_k(k) >= window``.
        device: where to build the result; default the device of ``bits``,
            else of ``positions``, else the CPU.

    Returns:
        ``[T, prefix_len + T]`` bool, True where query ``i`` sees key ``k``.
    """
    if device is None:
        device = bits.device if bits is not None else (positions.device if positions is not None else "cpu")
    device = torch.device(device)
    n_keys = prefix_len + n_tree
    visible = torch.ones(n_tree, n_keys, dtype=torch.bool, device=device)
    if bits is None:
        visible[:, prefix_len:] = torch.ones(n_tree, n_tree, dtype=torch.bool, device=device).tril()
    else:
        visible[:, prefix_len:] = _tree_bits_visible(bits, n_tree).to(device)
    if window is not None:
        if positions is None:
            pos_q = torch.arange(prefix_len, n_keys, device=device)
        else:
            pos_q = positions.to(device=device, dtype=torch.int64).reshape(n_tree)
        pos_k = torch.cat([torch.arange(prefix_len, device=device), pos_q])
        visible &= (pos_q[:, None] - pos_k[None, :]) < window
    return visible


def tree_attention_mask(bits: torch.Tensor, prefix_len: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Dense additive attention mask of a tree after a committed prefix.

    Args:
        bits: ``[T, W]`` int32 ancestor bitmask, ``W >= ceil(T / 32)``.
        prefix_len: number of committed keys before the tree keys, ``>= 0``.
        dtype: floating dtype of the mask.

    Returns:
        ``[T, prefix_len + T]`` of ``dtype`` on ``bits.device``: 0 where query
        ``i`` sees key ``k`` (every prefix key; tree key ``j = k - prefix_len``
        iff bit ``j % 32`` of ``bits[i, j // 32]`` is set), and
        ``torch.finfo(dtype).min`` elsewhere (finite, so softmax never sees NaN).
    """
    t = bits.shape[0]
    mask = torch.zeros(t, prefix_len + t, dtype=dtype, device=bits.device)
    mask[:, prefix_len:].masked_fill_(~_tree_bits_visible(bits, t), torch.finfo(dtype).min)
    return mask


def _explicit_attention(q, k, v, visible, scale, softcap, sinks):
    """Grouped-head attention with softcap and sinks, float32; ``[Hq, T, D]``.

    ``q [Hq, T, D]``, ``k, v [Hkv, S, D]``, ``visible [T, S]`` bool. Query head
    ``h = kv * G + g`` reads kv head ``kv``: the queries are viewed as ``[Hkv,
    G * T, D]`` so K/V are never repeated per query head. Scores ``s = q.k *
    scale``; with ``softcap`` ``c``: ``c * tanh(s / c)``; hidden keys ``-inf``;
    with ``sinks``: one more column ``sinks[h]``; softmax over the row (a row
    of only ``-inf`` gives zeros); the sink column dropped; times V.
    """
    hq, t, d = q.shape
    hkv, s, _ = k.shape
    g = hq // hkv
    scores = torch.matmul(q.float().reshape(hkv, g * t, d), k.float().transpose(1, 2)) * scale
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    scores = scores.view(hkv, g, t, s).masked_fill(~visible, float("-inf"))
    if sinks is not None:
        column = sinks.to(device=scores.device, dtype=torch.float32).view(hkv, g, 1, 1).expand(hkv, g, t, 1)
        scores = torch.cat([scores, column], dim=-1)
    top = scores.amax(dim=-1, keepdim=True)
    top = torch.where(top == float("-inf"), torch.zeros_like(top), top)
    weights = torch.exp(scores - top)
    total = weights.sum(dim=-1, keepdim=True)
    probs = weights / torch.where(total == 0, torch.ones_like(total), total)
    if sinks is not None:
        probs = probs[..., :s]
    return torch.matmul(probs.reshape(hkv, g * t, s), v.float()).view(hq, t, d)


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
) -> torch.Tensor:
    """Attention of T queries over ``[prefix ; tree]`` keys (SDPA with GQA, or explicit).

    Args:
        query: ``[Hq, T, D]`` or ``[1, Hq, T, D]``.
        key, value: ``[Hkv, S, D]`` or ``[1, Hkv, S, D]`` with ``S >= prefix_len + T``
            (the first ``prefix_len + T`` keys are used); ``Hq % Hkv == 0`` and
            query head ``h`` reads kv head ``h // (Hq // Hkv)``.
        bits: ``[T, W]`` int32 bitmask, or None for a causal chain.
        prefix_len: number of keys before the tree keys.
        scale: softmax scale, default ``D ** -0.5``.
        positions, window: sliding window, see :func:`tree_visibility`.
        softcap: None or ``c > 0``: scores ``s = q.k * scale`` become
            ``c * tanh(s / c)`` before the mask (Gemma 2).
        sinks: None or ``[Hq]`` floats: query head ``h``'s softmax gets one
            more logit ``sinks[h]`` whose probability is dropped (gpt-oss, as
            transformers' eager attention applies it: a row that sees no key
            gives 0).

    Returns:
        ``softmax(q k^T * scale + mask) v`` with the visibility of
        :func:`tree_visibility`, computed in float32 (K/V are not repeated
        per query head) and returned in the query's dtype and rank. Without
        softcap and sinks (SDPA) every query must see at least one key
        (itself always does); with either, a row that sees none gives 0.
    """
    batched = query.dim() == 4
    q = query[0] if batched else query
    k = key[0] if key.dim() == 4 else key
    v = value[0] if value.dim() == 4 else value
    hq, t, d = q.shape
    k = k[:, : prefix_len + t].float()
    v = v[:, : prefix_len + t].float()
    visible = tree_visibility(bits, prefix_len, t, positions=positions, window=window, device=q.device)
    scale = d**-0.5 if scale is None else scale
    if softcap is not None or sinks is not None:
        out = _explicit_attention(q, k, v, visible, scale, softcap, sinks)
    else:
        out = F.scaled_dot_product_attention(q.float(), k, v, attn_mask=visible, scale=scale, enable_gqa=True)
    out = out.to(query.dtype)
    return out.unsqueeze(0) if batched else out
