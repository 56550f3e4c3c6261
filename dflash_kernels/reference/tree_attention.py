"""Pure-torch reference of DDTree verification attention (SPEC section 7.3).

The tree tokens (root first, then nodes in pop order) attend to the whole
committed prefix and, among the tree tokens, to themselves and their ancestors
only. The visibility comes from the packed ancestor bitmask of
:func:`dflash_kernels.ancestor_bits`; here it is expanded to a dense additive
mask and fed to ``torch.nn.functional.scaled_dot_product_attention``.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

__all__ = ["tree_attention_mask", "tree_attention"]


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
    j = torch.arange(t, device=bits.device)
    words = bits[:, j // 32].to(torch.int64) & 0xFFFFFFFF
    visible = ((words >> (j % 32)) & 1).bool()
    mask = torch.zeros(t, prefix_len + t, dtype=dtype, device=bits.device)
    mask[:, prefix_len:].masked_fill_(~visible, torch.finfo(dtype).min)
    return mask


def tree_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    bits: torch.Tensor,
    prefix_len: int,
    scale: Optional[float] = None,
) -> torch.Tensor:
    """Attention of T tree queries over ``[prefix ; tree]`` keys.

    Args:
        query: ``[Hq, T, D]`` or ``[1, Hq, T, D]``.
        key, value: ``[Hkv, S, D]`` or ``[1, Hkv, S, D]`` with ``S = prefix_len + T``;
            ``Hq % Hkv == 0`` and query head ``h`` reads kv head ``h // (Hq // Hkv)``.
        bits: ``[T, W]`` int32 ancestor bitmask.
        prefix_len: number of committed keys.
        scale: softmax scale, default ``D ** -0.5``.

    Returns:
        ``softmax(q k^T * scale + mask) v`` with the mask of
        :func:`tree_attention_mask`, computed in float32 and returned in the
        query's dtype and rank.
    """
    batched = query.dim() == 4
    q = query[0] if batched else query
    k = key[0] if key.dim() == 4 else key
    v = value[0] if value.dim() == 4 else value
    hq, t, d = q.shape
    group = hq // k.shape[0]
    k = k[:, : prefix_len + t].float().repeat_interleave(group, dim=0)
    v = v[:, : prefix_len + t].float().repeat_interleave(group, dim=0)
    mask = tree_attention_mask(bits, prefix_len, torch.float32)
    scale = d**-0.5 if scale is None else scale
    out = F.scaled_dot_product_attention(q.float(), k, v, attn_mask=mask, scale=scale).to(query.dtype)
    return out.unsqueeze(0) if batched else out
