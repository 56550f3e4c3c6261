"""The target's fixed-shape passes (compiled / CUDA-graph rounds): device-side cache length, full-cache attention.

A compiled round may not hold a Python value that changes per round, and its
tensors may not change shape. :class:`StaticTargetKVCache` is the target's
cache with, once :meth:`~StaticTargetKVCache.freeze` has run, the committed
length ``length_t [1]`` int64 on the device:

* a pass of ``T`` rows (``T`` fixed: ``B`` for the chain, ``budget + 1`` for
  the tree, 1 for an AR step) writes rows ``[L, L + T)`` of every layer by
  index (``index_copy_`` at ``L + arange(T)``), and hands attention the WHOLE
  layer ``[1, Hkv, S, D]`` plus ``L``; attention reads keys ``[0, L)`` and
  the pass's rows as a chain or a tree and masks every key past ``L + T``
  (:func:`dflash_kernels.tree_attention` with a device ``prefix_len``), as paged /
  flash-decoding kernels mask by length;
* the round commits on the device: ``length_t += accepted + 1`` (chain) or,
  after :func:`dflash_kernels.compact_kv_` (a device ``dst_start``) moved the path's
  rows, ``length_t += path_len`` (tree).

The prompt is prefilled eagerly before :meth:`freeze` (its shapes vary with
the prompt), with the ordinary paths of :class:`~dflash.target.cache.TargetKVCache`.

:func:`static_forward` is :meth:`TargetAdapter.forward` for such a pass: the
layers called in order with the static cache and a
:class:`~dflash.target.attention.AttentionPass` whose ``prefix_len`` is ``length_t``; the captured layers'
outputs come back as a list (no hooks: a traced pass has no side effects
outside its tensors).
"""

from __future__ import annotations

from typing import List, Optional, Tuple

import torch

import dflash_kernels

from .attention import PASS_KWARG, AttentionPass
from .cache import TargetKVCache

__all__ = ["StaticTargetKVCache", "static_forward"]


class StaticTargetKVCache(TargetKVCache):
    """:class:`TargetKVCache` whose committed length moves to the device at :meth:`freeze`
    (``kv=``: caller storage, see :class:`~dflash.kv_buffer.KVBuffer`)."""

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        if not self.static:
            return super().update(key_states, value_states, layer_idx, *args, **kwargs)
        T = key_states.shape[-2]
        dflash_kernels.kv_write_(self.kv, layer_idx, self.length_t + self.rows[:T], key_states[0], value_states[0])
        layer = self.kv[layer_idx]
        return layer[0][None], layer[1][None]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        if self.static:
            raise RuntimeError("a frozen static cache keeps its length on the device (length_t); "
                               "get_seq_length would read it on the host")
        return self.length


def static_forward(adapter, ids: torch.Tensor, positions: torch.Tensor, cache: StaticTargetKVCache,
                   tree_bits: Optional[torch.Tensor] = None,
                   backend: Optional[str] = None) -> Tuple[torch.Tensor, List[torch.Tensor]]:
    """The decoder on ``ids [T]`` at ``positions [T]`` (device) over a frozen static cache.

    Returns ``(hidden [T, H] pre-norm, captured)`` with ``captured[i] [T, H]``
    the output of layer ``adapter.capture_layer_ids[i]``. Visibility as
    :meth:`TargetAdapter.forward`: committed keys, then the pass's rows as a
    causal chain or, with ``tree_bits [T, W]``, ancestors-or-self (positions
    then ``start + depth``).
    """
    spec = adapter.spec
    features = adapter._has_attn_features
    backend = backend or dflash_kernels.get_backend(adapter.device)
    visible = None
    if backend != "triton":  # one visibility mask per distinct window, shared by every layer of the pass
        T, S = ids.shape[0], cache.max_len
        tree_pos = positions if tree_bits is not None else None
        visible = {w: dflash_kernels.tree_visibility(tree_bits, cache.length_t, T, n_keys=S, positions=tree_pos,
                                                     window=w)
                   for w in set(adapter.windows)}
    attention_pass = AttentionPass(
        prefix_len=cache.length_t,
        bits=tree_bits,
        positions=positions if tree_bits is not None else None,
        windows=adapter.windows,
        backend=backend,
        softcaps=spec.attn_softcaps if features else (),
        sinks=spec.sinks if features else (),
        visible=visible,
    )
    pos = positions[None]
    h = adapter.embed(ids[None])
    rope = adapter._position_embeddings(h, pos)
    kw = {adapter._cache_kw: cache, PASS_KWARG: attention_pass}
    outputs = {}
    for idx, (layer, position_embeddings) in enumerate(zip(adapter.layers, rope)):
        # .forward: the adapter's capture hooks stay out of a traced pass (the outputs are returned instead)
        out = layer.forward(h, attention_mask=None, position_ids=pos, position_embeddings=position_embeddings,
                            use_cache=True, **kw)
        h = out[0] if isinstance(out, (tuple, list)) else out
        outputs[idx] = h[0]
    captured = [outputs[k] for k in adapter.capture_layer_ids]
    return h[0], captured
