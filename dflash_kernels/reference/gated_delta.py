"""Pure-torch reference of the Gated-DeltaNet ops of hybrid targets: the spec in code.

A hybrid target (Qwen3.5, Qwen3-Next) interleaves full-attention layers with
Gated-DeltaNet layers. Such a layer keeps, per sequence, a depthwise causal
convolution window and a recurrent state; speculative verification runs a
chain or a tree of tokens through it in one pass, and the commit must leave
the state after exactly the accepted path.

Recurrence (per value head ``h``; its key head is ``h // (Hv // Hk)``; all math fp32)::

    S_p     = state of node i's parent (the committed ``state`` when parents[i] == -1)   [Dk, Dv]
    S'      = exp(g[i, h]) * S_p
    kv      = S'^T k_i                                                                     [Dv]
    delta   = beta[i, h] * (v_i - kv)                                                      [Dv]
    S_i     = S' + k_i delta^T                                                             [Dk, Dv]
    o_i     = S_i^T q_i                                                                    [Dv]

with ``q_i, k_i`` l2-normalized first when ``qk_l2norm`` (``x * rsqrt(sum x^2 +
1e-6)`` in fp32, transformers' ``l2norm``) and ``q_i`` multiplied by ``scale``
(default ``Dk ** -0.5``). This is transformers' ``torch_recurrent_gated_delta_rule``
(one token at a time) where the previous state is the parent's instead of the
previous token's.

Convolution (depthwise, kernel ``K``, ``weight [C, K]``): the taps of node
``i`` are its own input and its ``K - 1`` nearest ancestors' inputs, oldest
first; once the chain of ancestors passes the root it continues into the
committed ``window [K-1, C]`` (rows oldest first), most recent row first.
Computed as transformers' ``causal_conv1d_update``: inputs cast to the
weight's dtype, ``F.conv1d`` over the ``K`` taps, then the activation, then
back to ``x``'s dtype.

Batches: every op also takes ``b`` sequences at once (a leading ``[b]``, after
the layer dim ``[L]`` where there is one), each with its own tree / accepted
rows / count; the reference runs the one-sequence rule on each sequence's
slice (views, so the in-place replay writes each sequence's state in place).

No function here reads a tensor value on the host: the parent of a node, the
accepted rows and their count are all used through device-side indexing, so
the reference is usable on a GPU without syncs (only the Python loops over
the node count ``N`` and the row buffer length ``A``, both shapes, remain).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

__all__ = [
    "gated_delta_tree",
    "gated_delta_replay_",
    "causal_conv_tree",
    "conv_window_after",
    "conv_taps",
    "l2norm",
]


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``x * rsqrt(sum(x^2, -1) + eps)`` in fp32 (transformers' ``l2norm``, done in fp32 as its rule does)."""
    x = x.float()
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def _prepare(q, k, v, g, beta, scale, qk_l2norm, n_v_heads):
    """fp32 per-value-head tensors: q, k ``[N, Hv, Dk]`` (GQA expanded), v ``[N, Hv, Dv]``, g / beta ``[N, Hv]``.

    ``q`` None (a replay: the state never reads it) stays None."""
    group = n_v_heads // k.shape[-2]

    def per_value_head(x, factor=None):
        x = l2norm(x) if qk_l2norm else x.float()
        if factor is not None:
            x = x * factor
        return x.repeat_interleave(group, dim=-2) if group != 1 else x

    if q is not None:
        q = per_value_head(q, q.shape[-1] ** -0.5 if scale is None else scale)
    return q, per_value_head(k), v.float(), g.float(), beta.float()


def _advance(s, k, v, g, beta):
    """The state update of one step for every value head: ``s [..., Hv, Dk, Dv]`` -> the new ``s``."""
    s = s * g.exp()[..., None, None]
    kv = (s * k[..., :, None]).sum(-2)
    delta = (v - kv) * beta[..., None]
    return s + k[..., :, None] * delta[..., None, :]


def _step(s, q, k, v, g, beta):
    """One recurrence step: ``(new s, o [..., Hv, Dv] = new s^T q)``."""
    s = _advance(s, k, v, g, beta)
    return s, (s * q[..., :, None]).sum(-2)


def gated_delta_tree(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                     state: torch.Tensor, parents: Optional[torch.Tensor] = None, *, scale: Optional[float] = None,
                     qk_l2norm: bool = True, scratch: Optional[torch.Tensor] = None, check: bool = False,
                     store_states: str = "all") -> torch.Tensor:
    """Gated-delta recurrence over a tree of ``N`` nodes (a chain when ``parents`` is None).

    Args:
        q, k: ``[N, Hk, Dk]``; v: ``[N, Hv, Dv]`` (any float dtype, ``Hv % Hk == 0``).
        g: ``[N, Hv]`` log-decay; beta: ``[N, Hv]``.
        state: ``[Hv, Dk, Dv]`` fp32 committed state (not modified).
        parents: ``[N]`` int, ``parents[i]`` in ``[-1, i)``; None: the chain ``-1, 0, ..., N-2``.
        scratch: optional fp32 ``[>= N, Hv, Dk, Dv]``; when given, ``scratch[i]`` receives node i's state.
        check, store_states: accepted for parity with :func:`dflash_kernels.gated_delta_tree`
            (which validates); the reference always computes every node's state.

    A batch: every tensor above with a leading ``[b]`` (``q [b, N, Hk, Dk]``,
    ``state [b, Hv, Dk, Dv]``, ``parents [b, N]``, ``scratch [b, >= N, ...]``):
    sequence ``r``'s tree from its own state, outputs ``[b, N, Hv, Dv]``.

    Returns:
        ``[N, Hv, Dv]`` outputs ``o_i`` in ``v.dtype``.
    """
    if q.dim() == 4:
        return torch.stack([
            gated_delta_tree(q[r], k[r], v[r], g[r], beta[r], state[r], None if parents is None else parents[r],
                             scale=scale, qk_l2norm=qk_l2norm, scratch=None if scratch is None else scratch[r])
            for r in range(q.shape[0])]) if q.shape[0] else v.new_empty(v.shape)
    n, n_v_heads, out_dtype = v.shape[0], v.shape[1], v.dtype
    q, k, v, g, beta = _prepare(q, k, v, g, beta, scale, qk_l2norm, n_v_heads)
    out = torch.empty(n, n_v_heads, v.shape[-1], dtype=torch.float32, device=v.device)
    # states[0] is the committed state, states[i + 1] node i's: a parent index p reads states[p + 1].
    states = None if parents is None else state.new_empty((n + 1,) + tuple(state.shape), dtype=torch.float32)
    s = state.float()
    if states is not None:
        states[0] = s
        slot = parents.to(device=v.device, dtype=torch.int64) + 1
    for i in range(n):
        if states is not None:
            s = states.index_select(0, slot[i:i + 1])[0]  # device-side gather: no host read of parents
        s, out[i] = _step(s, q[i], k[i], v[i], g[i], beta[i])
        if states is not None:
            states[i + 1] = s
        if scratch is not None:
            scratch[i].copy_(s)
    return out.to(out_dtype)


def gated_delta_replay_(state: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                        beta: torch.Tensor, rows: torch.Tensor, num_rows: torch.Tensor, *,
                        scale: Optional[float] = None, qk_l2norm: bool = True, check: bool = False) -> None:
    """Advance ``state`` in place through the chain ``rows[0], ..., rows[n-1]``, ``n = clamp(num_rows, 0, A)``.

    Args:
        state: fp32 ``[Hv, Dk, Dv]``, or ``[L, Hv, Dk, Dv]`` for ``L`` layers at once.
        q, k: ``[N, Hk, Dk]`` (``[L, N, Hk, Dk]``); v ``[N, Hv, Dv]``; g, beta ``[N, Hv]`` (leading ``[L]`` likewise).
        rows: ``[A]`` int on the state's device (the same rows for every layer); entries ``>= n`` ignored.
        num_rows: ``[1]`` (or ``[]``) int on the state's device: the count stays on the device.

    A batch: ``state [L, b, Hv, Dk, Dv]`` (inputs ``[L, b, N, ...]``), ``rows [A]``
    (every sequence's) or ``[b, A]``, ``num_rows [1]`` / ``[]`` or ``[b]``:
    sequence ``r`` advances through ``rows[r, :num_rows[r]]``.

    Every one of the ``A`` steps is computed (rows clamped into range) and kept
    only where ``j < n`` (``torch.where``), so nothing is read on the host.
    """
    if state.dim() == 5:
        counts = num_rows.reshape(-1)
        for r in range(state.shape[1]):
            gated_delta_replay_(state[:, r], None, k[:, r], v[:, r], g[:, r], beta[:, r],
                                rows if rows.dim() == 1 else rows[r], counts[r if counts.numel() > 1 else 0],
                                scale=scale, qk_l2norm=qk_l2norm)
        return
    batched = state.dim() == 4
    if not batched:
        state_l, k, v, g, beta = state[None], k[None], v[None], g[None], beta[None]
    else:
        state_l = state
    n_v_heads = v.shape[-2]
    _, kf, vf, gf, bf = _prepare(None, k, v, g, beta, scale, qk_l2norm, n_v_heads)
    n_nodes = v.shape[1]
    idx = rows.to(device=state.device, dtype=torch.int64).clamp(0, max(n_nodes - 1, 0))
    count = num_rows.reshape(()).to(device=state.device, dtype=torch.int64)
    s = state_l.float()
    for j in range(rows.shape[0]):
        if n_nodes == 0:
            break
        r = idx[j:j + 1]
        new = _advance(s, kf.index_select(1, r)[:, 0], vf.index_select(1, r)[:, 0], gf.index_select(1, r)[:, 0],
                       bf.index_select(1, r)[:, 0])
        s = torch.where(count > j, new, s)
    state_l.copy_(s)


def conv_taps(parents: Optional[torch.Tensor], n: int, kernel_size: int, device=None) -> torch.Tensor:
    """Indices ``[N, K]`` into ``concat(window, x)`` (window rows ``0..K-2``, node i at ``K-1+i``) of node i's taps.

    Column ``j`` is the tap that multiplies ``weight[:, j]``: column ``K-1`` is
    the node itself, column ``K-1-m`` its ``m``-th ancestor, continuing past the
    root into the window most recent row first (``K-2``, then ``K-3``, ...).
    A node at depth ``d`` (``d = 0`` for a child of the root) needs ``K-1-d``
    window rows at most, so the walk never leaves the window.
    """
    km1 = kernel_size - 1
    if parents is None:
        par = torch.arange(n, device=device, dtype=torch.int64) - 1
    else:
        par = parents.to(device=device, dtype=torch.int64)
    taps = torch.empty(n, kernel_size, dtype=torch.int64, device=device)
    cur = torch.arange(n, device=device, dtype=torch.int64) + km1
    taps[:, km1] = cur
    for m in range(1, kernel_size):
        is_node = cur >= km1
        node = (cur - km1).clamp(0, max(n - 1, 0))
        p = par.index_select(0, node) if n > 0 else node
        from_node = torch.where(p >= 0, p + km1, torch.full_like(p, km1 - 1))
        cur = torch.where(is_node, from_node, cur - 1)
        taps[:, km1 - m] = cur
    return taps


def causal_conv_tree(x: torch.Tensor, window: torch.Tensor, weight: torch.Tensor,
                     parents: Optional[torch.Tensor] = None, *, bias: Optional[torch.Tensor] = None,
                     activation: Optional[str] = "silu", check: bool = False) -> torch.Tensor:
    """Depthwise causal conv over a tree: ``y_i = act(sum_j weight[:, j] * taps_i[j] (+ bias))`` ``[N, C]``.

    ``x [N, C]``, ``window [K-1, C]`` (oldest first), ``weight [C, K]``, ``bias [C]``
    or None, ``activation`` ``"silu"`` or None. Exactly transformers'
    ``causal_conv1d_update`` steps per node: the ``[N, C, K]`` taps cast to the
    weight's dtype, ``F.conv1d(groups=C)``, the activation, cast to ``x.dtype``.
    A batch: ``x [b, N, C]``, ``window [b, K-1, C]``, ``parents [b, N]`` (or
    None): each sequence's tree over its own window, ``[b, N, C]``.
    """
    if x.dim() == 3:
        return torch.stack([
            causal_conv_tree(x[r], window[r], weight, None if parents is None else parents[r], bias=bias,
                             activation=activation) for r in range(x.shape[0])]) if x.shape[0] else x.new_empty(x.shape)
    n, channels = x.shape
    kernel_size = weight.shape[1]
    taps = conv_taps(parents, n, kernel_size, device=x.device)
    ext = torch.cat([window.to(x.dtype), x], dim=0)  # [K-1+N, C]
    gathered = ext.index_select(0, taps.reshape(-1)).reshape(n, kernel_size, channels)
    inputs = gathered.transpose(1, 2).to(weight.dtype)  # [N, C, K], oldest tap first
    y = F.conv1d(inputs, weight.unsqueeze(1), bias, padding=0, groups=channels)[:, :, -1]
    if activation == "silu":
        y = F.silu(y)
    elif activation is not None:
        raise ValueError(f"causal_conv_tree: activation must be 'silu' or None, got {activation!r}")
    return y.to(x.dtype)


def conv_window_after(window: torch.Tensor, x: torch.Tensor, rows: torch.Tensor,
                      num_rows: torch.Tensor) -> torch.Tensor:
    """The last ``K-1`` rows of ``concat(window, x[rows[:n]])``, ``n = clamp(num_rows, 0, A)``.

    ``window [K-1, C]`` and ``x [N, C]`` (or ``[L, K-1, C]`` / ``[L, N, C]``,
    the same rows for every layer); ``rows [A]``, ``num_rows [1]`` int on the
    device. Output row ``j`` is sequence entry ``t = n + j`` of the
    concatenation: window row ``t`` when ``t < K-1``, else ``x[rows[t - (K-1)]]``.
    Pure index math (two gathers and a select): no host read, fixed shapes.
    A batch: ``window [L, b, K-1, C]``, ``x [L, b, N, C]``, ``rows [A]`` or
    ``[b, A]``, ``num_rows [1]`` / ``[]`` or ``[b]``: each sequence's window after
    its own rows.
    """
    if window.dim() == 4:
        counts = num_rows.reshape(-1)
        return torch.stack([
            conv_window_after(window[:, r], x[:, r], rows if rows.dim() == 1 else rows[r],
                              counts[r if counts.numel() > 1 else 0]) for r in range(window.shape[1])],
            dim=1) if window.shape[1] else window.clone()
    batched = window.dim() == 3
    w = window if batched else window[None]
    xs = x if batched else x[None]
    km1, n_nodes, a = w.shape[1], xs.shape[1], rows.shape[0]
    device = w.device
    count = num_rows.reshape(()).to(device=device, dtype=torch.int64).clamp(0, a)
    t = count + torch.arange(km1, device=device, dtype=torch.int64)  # [K-1]
    from_window = t < km1
    widx = t.clamp(max=max(km1 - 1, 0))
    ridx = (t - km1).clamp(0, max(a - 1, 0))
    if a > 0 and n_nodes > 0:
        node = rows.to(device=device, dtype=torch.int64).index_select(0, ridx).clamp(0, n_nodes - 1)
        from_x = xs.index_select(1, node).to(w.dtype)
    else:
        from_x = torch.zeros_like(w)
    out = torch.where(from_window[None, :, None], w.index_select(1, widx), from_x)
    return out if batched else out[0]
