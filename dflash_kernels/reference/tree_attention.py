"""Pure-torch reference of the verification attention.

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

Device-side prefix (:func:`tree_attention` with ``prefix_len`` a tensor): for a step that ``torch.compile(fullgraph=True)``
or a CUDA graph captures, the committed length is an int64 device tensor
``p`` (shape ``[1]`` or ``[]``) and K/V are the WHOLE preallocated cache views
``[Hkv, S_max, D]`` (``S_max >= p + T``): the tree keys are rows ``[p, p + T)``,
rows ``>= p + T`` are invisible (their contents, NaN or inf included, never
reach the output: they are zeroed before the matmul, not only masked).
Visibility of cache row ``k`` to query ``i`` is the rule above with ``k``
compared to the tensor ``p`` (:func:`tree_visibility` with ``n_keys``), built from
``torch.arange(S_max)``: no host read, no data-dependent shape.

Batch: ``b`` independent sequences (rows) at once: query ``[b, Hq, T, D]``,
key/value ``[b, Hkv, S, D]``, the prefix an int (the same for every row) or a
device tensor ``[b]`` (per row, over the whole cache views ``[b, Hkv, S_max,
D]``), bits ``[T, W]`` (one tree for every row) or ``[b, T, W]``, positions
``[T]`` or ``[b, T]``. Row ``r`` of the output is the single-row call on row
``r``'s slices; the visibility is a ``[b, T, S]`` mask and the attention one
batched SDPA (or explicit softmax). A call of one row (no batch dim, or
``b = 1``) runs the single-row ops, unchanged.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

__all__ = ["tree_attention_mask", "tree_attention", "tree_visibility"]


def _tree_bits_visible(bits: torch.Tensor, n_tree: int) -> torch.Tensor:
    """``[T, T]`` (``[b, T, T]`` for ``[b, T, W]`` bits) bool: bit ``j % 32`` of ``bits[..., i, j // 32]``."""
    j = torch.arange(n_tree, device=bits.device)
    words = bits[..., :n_tree, j // 32].to(torch.int64) & 0xFFFFFFFF
    return ((words >> (j % 32)) & 1).bool()


def _visibility_batch(bits, prefix_len, positions) -> Optional[int]:
    """The batch size ``b`` of a visibility (None: one row, a ``[T, S]`` result): from ``[b, T, W]`` bits,
    ``[b, T]`` positions or a tensor prefix ``[b]`` of more than one element (``[1]`` / ``[]`` is shared)."""
    sizes = {}
    if bits is not None and bits.dim() == 3:
        sizes["bits"] = bits.shape[0]
    if positions is not None and positions.dim() == 2:
        sizes["positions"] = positions.shape[0]
    if isinstance(prefix_len, torch.Tensor) and prefix_len.numel() != 1:
        if prefix_len.dim() != 1:
            raise ValueError(f"tree_visibility: a tensor prefix_len must be [b], [1] or [], got "
                             f"{tuple(prefix_len.shape)}")
        sizes["prefix_len"] = prefix_len.shape[0]
    if len(set(sizes.values())) > 1:
        raise ValueError(f"tree_visibility: the batch sizes of {', '.join(sizes)} differ: {sizes}")
    return next(iter(sizes.values()), None)


def tree_visibility(
    bits: Optional[torch.Tensor],
    prefix_len: int,
    n_tree: int,
    positions: Optional[torch.Tensor] = None,
    window: Optional[int] = None,
    device=None,
    n_keys: Optional[int] = None,
) -> torch.Tensor:
    """Which keys each query sees: the spec of :func:`dflash_kernels.tree_attention`'s mask.

    Args:
        bits: ``[T, >= ceil(T/32)]`` int32 bitmask (tree key ``j`` visible to
            query ``i`` iff bit ``j`` of row ``i``), or None for a causal chain
            (``j <= i``); or ``[b, T, >= ceil(T/32)]``, a tree per batch row.
        prefix_len: keys before the tree keys, ``>= 0``; prefix key ``k`` has position ``k``.
            Or an int tensor (the device-prefix form, with ``n_keys``): ``[1]`` / ``[]``, or ``[b]`` per row.
        n_tree: T, the number of query (= tree key) tokens.
        positions: ``[T]`` (or per row ``[b, T]``) int absolute positions of
            the tree tokens, default ``prefix_len + arange(T)``; only used with ``window``.
        window: None, or an int ``>= 1``: also hide key ``k`` from query ``i``
            when ``pos_q(i) - pos_k(k) >= window``.
        device: where to build the result; default the device of ``bits``,
            else of ``positions``, else the CPU.

        n_keys: with ``prefix_len`` a tensor (the device-prefix form), the
            cache rows ``S_max`` the result covers (:func:`_visibility_device_prefix`).

    Returns:
        ``[T, prefix_len + T]`` bool, True where query ``i`` sees key ``k``
        (``[T, n_keys]`` for a tensor ``prefix_len``); ``[b, T, ...]`` when any
        input has a batch (``[b, T, W]`` bits, ``[b, T]`` positions, a ``[b]``
        prefix with ``b > 1``; their ``b`` must agree): row ``r`` is the
        visibility of row ``r``'s inputs, the others shared.
    """
    batch = _visibility_batch(bits, prefix_len, positions)
    if isinstance(prefix_len, torch.Tensor):
        if n_keys is None:
            raise ValueError("tree_visibility: a tensor prefix_len needs n_keys (the cache rows S_max to cover)")
        return _visibility_device_prefix(bits, prefix_len, n_tree, n_keys, positions=positions, window=window,
                                         device=device, batch=batch)
    if n_keys is not None and n_keys != prefix_len + n_tree:
        raise ValueError(f"tree_visibility: with an int prefix_len the keys are prefix_len + T = "
                         f"{prefix_len + n_tree}, got n_keys={n_keys}")
    if device is None:
        device = bits.device if bits is not None else (positions.device if positions is not None else "cpu")
    device = torch.device(device)
    n_keys = prefix_len + n_tree
    lead = () if batch is None else (batch,)
    visible = torch.ones(*lead, n_tree, n_keys, dtype=torch.bool, device=device)
    if bits is None:
        visible[..., prefix_len:] = torch.ones(n_tree, n_tree, dtype=torch.bool, device=device).tril()
    else:
        visible[..., prefix_len:] = _tree_bits_visible(bits, n_tree).to(device)
    if window is not None:
        if positions is None:
            pos_q = torch.arange(prefix_len, n_keys, device=device)
        else:
            pos_q = positions.to(device=device, dtype=torch.int64).reshape(*positions.shape[:-1], n_tree)
        pos_k = torch.cat([torch.arange(prefix_len, device=device).expand(*pos_q.shape[:-1], prefix_len), pos_q],
                          dim=-1)
        visible &= (pos_q[..., :, None] - pos_k[..., None, :]) < window
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
    """Grouped-head attention with softcap and sinks, float32; ``[..., Hq, T, D]``.

    ``q [..., Hq, T, D]``, ``k [..., Hkv, S, D]``, ``v [..., Hkv, S, Dv]`` (the same leading batch
    dims, or none), ``visible [T, S]`` or ``[b, T, S]`` bool. Query head ``h =
    kv * G + g`` reads kv head ``kv``: the queries are viewed as ``[..., Hkv,
    G * T, D]`` so K/V are never repeated per query head. Scores ``s = q.k *
    scale``; with ``softcap`` ``c``: ``c * tanh(s / c)``; hidden keys
    ``-inf``; with ``sinks``: one more column ``sinks[h]``; softmax over the
    row (a row of only ``-inf`` gives zeros); the sink column dropped; times V.
    """
    lead = q.shape[:-3]
    hq, t, d = q.shape[-3:]
    hkv, s = k.shape[-3], k.shape[-2]
    g = hq // hkv
    scores = torch.matmul(q.float().reshape(*lead, hkv, g * t, d), k.float().transpose(-1, -2)) * scale
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    if visible.dim() == 3:  # a visibility per batch row
        visible = visible[:, None, None]
    scores = scores.view(*lead, hkv, g, t, s).masked_fill(~visible, float("-inf"))
    if sinks is not None:
        column = sinks.to(device=scores.device, dtype=torch.float32).view(hkv, g, 1, 1).expand(*lead, hkv, g, t, 1)
        scores = torch.cat([scores, column], dim=-1)
    top = scores.amax(dim=-1, keepdim=True)
    top = torch.where(top == float("-inf"), torch.zeros_like(top), top)
    weights = torch.exp(scores - top)
    total = weights.sum(dim=-1, keepdim=True)
    probs = weights / torch.where(total == 0, torch.ones_like(total), total)
    if sinks is not None:
        probs = probs[..., :s]
    return torch.matmul(probs.reshape(*lead, hkv, g * t, s), v.float()).view(*lead, hq, t, v.shape[-1])


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
        query: ``[Hq, T, D]`` or ``[b, Hq, T, D]`` (``b`` independent rows).
        key, value: ``[Hkv, S, D]`` or ``[b, Hkv, S, D]`` with ``S >= prefix_len + T``
            (the first ``prefix_len + T`` keys are used); ``Hq % Hkv == 0`` and
            query head ``h`` reads kv head ``h // (Hq // Hkv)``.
        bits: ``[T, W]`` int32 bitmask (every row's), ``[b, T, W]`` (a tree per
            row), or None for a causal chain.
        prefix_len: number of keys before the tree keys (every row's); a tensor
            (``[b]``, or ``[1]`` / ``[]`` for one row): the device-prefix form,
            see :func:`_attention_device_prefix`.
        scale: softmax scale, default ``D ** -0.5``.
        positions, window: sliding window, see :func:`tree_visibility`
            (positions ``[T]`` or per row ``[b, T]``).
        softcap: None or ``c > 0``: scores ``s = q.k * scale`` become
            ``c * tanh(s / c)`` before the mask (Gemma 2).
        sinks: None or ``[Hq]`` floats (every row's): query head ``h``'s
            softmax gets one more logit ``sinks[h]`` whose probability is
            dropped (gpt-oss, as transformers' eager attention applies it: a
            row that sees no key gives 0).

    Returns:
        ``softmax(q k^T * scale + mask) v`` with the visibility of
        :func:`tree_visibility`, computed in float32 (K/V are not repeated
        per query head) and returned in the query's dtype and rank; row ``r``
        of a batch is the single-row call on row ``r``'s slices. Without
        softcap and sinks (SDPA) every query must see at least one key
        (itself always does); with either, a row that sees none gives 0.
    """
    if query.dim() == 4 and query.shape[0] != 1:
        return _attention_batched(query, key, value, bits, prefix_len, scale, positions, window, softcap, sinks)
    # One row: the single-row ops (a [1, ...] bits / positions is that row's)
    bits = bits[0] if bits is not None and bits.dim() == 3 else bits
    positions = positions[0] if positions is not None and positions.dim() == 2 else positions
    if isinstance(prefix_len, torch.Tensor):
        return _attention_device_prefix(query, key, value, bits, prefix_len, scale, positions=positions,
                                        window=window, softcap=softcap, sinks=sinks)
    q, k, v = _unbatched(query, key, value)
    t = q.shape[1]
    k = k[:, : prefix_len + t].float()
    v = v[:, : prefix_len + t].float()
    visible = tree_visibility(bits, prefix_len, t, positions=positions, window=window, device=q.device)
    return _attend(query, q, k, v, visible, scale, softcap, sinks)


def _unbatched(query, key, value):
    """``[Hq, T, D]``, ``[Hkv, S, D]`` views of inputs given with or without a batch dim of 1."""
    return tuple(x[0] if x.dim() == 4 else x for x in (query, key, value))


def _attend(query, q, k, v, visible, scale, softcap, sinks) -> torch.Tensor:
    """float32 attention of ``q [Hq, T, D]`` over fp32 ``k, v [Hkv, S, D]`` with ``visible [T, S]`` (SDPA, or
    explicit with a softcap / sinks), in ``query``'s dtype and rank. Batched: ``q [b, Hq, T, D]``, ``k, v [b,
    Hkv, S, D]``, ``visible [T, S]`` or ``[b, T, S]``, one SDPA over the batch."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if softcap is not None or sinks is not None:
        out = _explicit_attention(q, k, v, visible, scale, softcap, sinks)
    else:
        mask = visible[:, None] if q.dim() == 4 and visible.dim() == 3 else visible
        out = F.scaled_dot_product_attention(q.float(), k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    out = out.to(query.dtype)
    return out.unsqueeze(0) if query.dim() == 4 and out.dim() == 3 else out


def _attention_batched(query, key, value, bits, prefix_len, scale, positions, window, softcap, sinks):
    """:func:`tree_attention` of ``b != 1`` rows: one ``[b, T, S]`` visibility, one batched attention."""
    b, _, t, _ = query.shape
    k, v = key, value
    if isinstance(prefix_len, torch.Tensor):
        s_max = k.shape[-2]
        p = _prefix_rows(prefix_len, query.device)
        live = (torch.arange(s_max, device=query.device)[None, :] < p + t)[:, None, :, None]  # [b, 1, S_max, 1]
        zero = torch.zeros((), dtype=torch.float32, device=query.device)
        k = torch.where(live, k.float(), zero)
        v = torch.where(live, v.float(), zero)
        visible = _visibility_device_prefix(bits, prefix_len, t, s_max, positions=positions, window=window,
                                            device=query.device, batch=b)
    else:
        k = k[..., : prefix_len + t, :].float()
        v = v[..., : prefix_len + t, :].float()
        visible = tree_visibility(bits, prefix_len, t, positions=positions, window=window, device=query.device)
    # contiguous like the kernel's output (a batched SDPA keeps a transposed query's layout)
    return _attend(query, query, k, v, visible, scale, softcap, sinks).contiguous()


def _prefix_scalar(prefix_len: torch.Tensor, device) -> torch.Tensor:
    """The committed length as a 0-d int64 tensor on ``device`` (a ``[1]`` / ``[]`` int tensor; no host read)."""
    return prefix_len.reshape(()).to(device=device, dtype=torch.int64)


def _prefix_rows(prefix_len: torch.Tensor, device) -> torch.Tensor:
    """The committed lengths as an int64 column ``[b, 1]`` (``[1, 1]`` for a shared one) on ``device``."""
    return prefix_len.reshape(-1, 1).to(device=device, dtype=torch.int64)


def _visibility_device_prefix(
    bits: Optional[torch.Tensor],
    prefix_len: torch.Tensor,
    n_tree: int,
    n_keys: int,
    positions: Optional[torch.Tensor] = None,
    window: Optional[int] = None,
    device=None,
    batch: Optional[int] = None,
) -> torch.Tensor:
    """:func:`tree_visibility` over a whole cache of ``n_keys = S_max`` rows, the prefix a device tensor.

    With ``p = prefix_len`` (int tensor ``[1]`` / ``[]``, or ``[b]`` a length
    per row), ``k = arange(S_max)`` and ``j = k - p`` (the tree key index
    where ``0 <= j < T``), row ``k`` is visible to query ``i`` iff::

        k < p                                   (a prefix key, position k)
        or 0 <= j < T and tree(i, j)            (bit j of bits[i]; or j <= i for a chain)

    and, with ``window``, ``pos_q(i) - pos_k(k) < window`` where ``pos_q(i) =
    positions[i]`` (default ``p + i``) and ``pos_k(k) = k`` for prefix keys,
    ``pos_q(j)`` for tree keys. Rows ``k >= p + T`` are never visible.
    Every op is a fixed-shape tensor op (``torch.compile(fullgraph=True)``
    traces it without a graph break). Batched (``batch = b``): each of ``p``,
    ``bits`` (``[b, T, W]``) and ``positions`` (``[b, T]``) may be per row or
    shared, row ``r`` of the result uses row ``r``'s.

    Returns:
        ``[T, S_max]`` bool (``[b, T, S_max]`` with ``batch``) on ``device``
        (default: bits', else positions', else prefix_len's device).
    """
    if device is None:
        device = bits.device if bits is not None else (positions.device if positions is not None
                                                       else prefix_len.device)
    device = torch.device(device)
    # Every tensor below has a leading row dim: 1 where shared (broadcast), b where per row.
    p = _prefix_rows(prefix_len, device)  # [1 or b, 1]
    rows = torch.arange(n_keys, device=device)
    node = rows[None, :] - p  # [1 or b, S_max]: the tree key index j of row k (negative: a prefix key)
    if bits is None and window is None:
        # a chain: row k is seen iff j <= i (every prefix key has j < 0, and j <= i < T keeps every row past the
        # tree out): one compare, where the general rule below takes eleven ops
        visible = node[:, None, :] <= torch.arange(n_tree, device=device)[None, :, None]
        return visible.reshape(n_tree, n_keys) if batch is None else visible.expand(batch, n_tree, n_keys).contiguous()
    in_tree = (node >= 0) & (node < n_tree)
    node = node.clamp(0, max(n_tree - 1, 0))
    if bits is None:
        tree = node[:, None, :] <= torch.arange(n_tree, device=device)[None, :, None]
    else:
        tree_bits = bits.to(device)
        tree_bits = (tree_bits if tree_bits.dim() == 3 else tree_bits[None])[:, :n_tree]  # [1 or b, T, W]
        r = max(tree_bits.shape[0], node.shape[0])
        index = (node // 32)[:, None, :].expand(r, n_tree, n_keys)
        words = torch.gather(tree_bits.expand(r, n_tree, tree_bits.shape[-1]), 2, index).to(torch.int64) \
            & 0xFFFFFFFF
        tree = ((words >> (node % 32)[:, None, :]) & 1).bool()
    visible = (rows[None, :] < p)[:, None, :] | (in_tree[:, None, :] & tree)
    if window is not None:
        if positions is None:
            pos_q = p + torch.arange(n_tree, device=device)  # [1 or b, T]
        else:
            pos_q = positions.to(device=device, dtype=torch.int64).reshape(-1, n_tree)
        r = max(pos_q.shape[0], node.shape[0])
        if n_tree > 0:
            tree_pos = torch.gather(pos_q.expand(r, n_tree), 1, node.expand(r, n_keys))
        else:
            tree_pos = rows.expand(r, n_keys)
        pos_k = torch.where(in_tree, tree_pos, rows)  # [r, S_max]
        visible = visible & ((pos_q[:, :, None] - pos_k[:, None, :]) < window)
    if batch is None:
        return visible.reshape(n_tree, n_keys)
    return visible.expand(batch, n_tree, n_keys).contiguous()


def _attention_device_prefix(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    bits: Optional[torch.Tensor],
    prefix_len: torch.Tensor,
    scale: Optional[float] = None,
    *,
    positions: Optional[torch.Tensor] = None,
    window: Optional[int] = None,
    softcap: Optional[float] = None,
    sinks: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """:func:`tree_attention` of one row with the committed length a device tensor, over the whole cache views.

    Args:
        query: ``[Hq, T, D]`` or ``[1, Hq, T, D]``.
        key, value: ``[Hkv, S_max, D]`` or ``[1, Hkv, S_max, D]``, the whole
            preallocated cache (any strides); the pass's T rows are
            ``[p, p + T)``, rows ``>= p + T`` may hold anything (they are
            zeroed before use, so not even NaN / inf leaks).
        bits, scale, positions, window, softcap, sinks: as :func:`tree_attention`.
        prefix_len: ``p``, an int64 (or int32) tensor ``[1]`` or ``[]`` on the
            query's device, ``0 <= p <= S_max - T`` (not checked: a check would
            read it on the host).

    Returns:
        As :func:`tree_attention` (float32 math, the query's dtype and rank).
        Compile-friendly: no ``.item()``, no data-dependent shape; the same
        values as ``tree_attention(q, k[:, :p+T], v[:, :p+T], bits, int(p))``.
        (``b`` rows with a ``[b]`` prefix: :func:`tree_attention` does the
        same per row, batched.)
    """
    q, k, v = _unbatched(query, key, value)
    t, s_max = q.shape[1], k.shape[1]
    p = _prefix_scalar(prefix_len, q.device)
    live = (torch.arange(s_max, device=q.device) < p + t)[None, :, None]
    zero = torch.zeros((), dtype=torch.float32, device=q.device)
    k = torch.where(live, k.float(), zero)
    v = torch.where(live, v.float(), zero)
    visible = _visibility_device_prefix(bits, p, t, s_max, positions=positions, window=window, device=q.device)
    return _attend(query, q, k, v, visible, scale, softcap, sinks)
