"""The ops of a fixed-shape (compiled / CUDA-graph) decoding round, by backend, ready to be traced.

``torch.compile(fullgraph=True)`` must see every op of a round without a
graph break, and a CUDA graph must be able to replay it. Each function here
takes the backend (``"triton"`` or ``"reference"``, fixed for a generation)
and calls:

* ``triton``: the ``torch.ops.dflash`` custom op (:mod:`dflash_kernels.ops`; the
  tree build over caller-held index tables, ``dflash::build_tree_device_static``,
  is registered here): one opaque node in the graph whose launches a CUDA graph
  captures;
* ``reference``: the pure-torch reference, when it is traceable (the static
  attention, the seeded samplers' hash noise, the index-math compaction), so
  inductor fuses it with the layers around it; else the custom op.

No function reads a tensor on the host: lengths, counts and seeds are device
tensors (``[1]`` int64), shapes depend only on the generation's settings.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from . import reference as _ref
from . import tree_device as _tree_device

#: nothing: these are the compiled round's per-backend dispatchers of ops public elsewhere (and its cache write,
#: an internal op of the fixed-shape caches), timed as part of the round by bench/compile_speed.py
__all__: list = []


def _ops():
    return torch.ops.dflash


from . import _C  # noqa: E402,F401  (registers the C++ op dflash::kv_write_, csrc/kv_write.cpp)


@torch.library.register_fake("dflash::kv_write_")
def _kv_write_fake(kv, layer, rows, key, value) -> None:
    return None


def kv_write_(kv: torch.Tensor, layer: int, rows: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
    """Write ``key/value [Hkv, T, D]`` into rows ``rows [T]`` (device int64, distinct) of layer ``layer`` of
    ``kv [L, 2, Hkv, S, D]``, in place (the C++ op ``torch.ops.dflash.kv_write_``, csrc/kv_write.cpp).

    An op (not the ``index_copy_`` it runs) because a traced in-place write
    through a view of the cache is functionalized into a copy of the WHOLE
    cache per layer; an op with a mutable argument is re-inplaced by inductor:
    the graph writes the ``T`` rows and nothing else.
    """
    torch.ops.dflash.kv_write_(kv, layer, rows, key, value)


def tree_attention_static(query, key, value, bits, prefix, *, scale=None, positions=None, window=None,
                          softcap=None, sinks=None, backend: str = "reference") -> torch.Tensor:
    """Attention of a pass's rows over the whole cache (``key/value [.., Hkv, S, D]``), ``prefix [1]`` committed.

    See :func:`dflash_kernels.reference.tree_attention_static` for the visibility rule.
    """
    if backend == "triton":
        return _ops().tree_attention_static(query, key, value, bits, prefix, scale, positions, window, softcap,
                                            sinks)
    return _ref.tree_attention_static(query, key, value, bits, prefix, scale, positions=positions, window=window,
                                      softcap=softcap, sinks=sinks)


def visibility(bits, prefix, n_rows: int, n_keys: int, *, positions=None, window=None) -> torch.Tensor:
    """``[T, S]`` bool: which cache rows each of a pass's ``T`` rows sees (the rule of
    :func:`dflash_kernels.reference.tree_visibility_static`; ``bits=None``: a causal chain)."""
    return _ref.tree_visibility_static(bits, prefix, n_rows, n_keys, positions=positions, window=window)


def masked_attention(query, key, value, visible, *, scale=None) -> torch.Tensor:
    """Reference attention of a pass over the whole cache with a precomputed ``visible [T, S]``.

    A pass computes its visibility once (:func:`visibility`, per distinct
    window) and every layer reuses it; SDPA with the boolean mask in the
    model's dtype, as the eager reference path runs it. Rows past the pass's
    keys get weight 0; they hold zeros or stale finite values of earlier passes
    (the caches are zero-initialized and only ever written with K/V).
    """
    if query.dim() == 3:  # [Hq, T, D] (the drafter's layout)
        return masked_attention(query[None], key[None], value[None], visible, scale=scale)[0]
    return torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=visible, scale=scale,
                                                            enable_gqa=True)


def lm_head_argmax(hidden, weight, *, norm_weight=None, eps=1e-6, positions=None, softcap=None,
                   backend: str = "reference") -> torch.Tensor:
    """Greedy tokens ``[N]`` (:func:`dflash_kernels.lm_head_argmax`, rows from our own loop: unchecked)."""
    if backend == "triton":
        return _ops().lm_head_argmax(hidden, weight, norm_weight, positions, eps, False, None, softcap)
    return _ref.lm_head_argmax(hidden, weight, norm_weight=norm_weight, eps=eps, positions=positions,
                               check_bounds=False, softcap=softcap)


def lm_head_topk(hidden, weight, k: int, *, norm_weight=None, eps=1e-6, positions=None, softcap=None,
                 backend: str = "reference"):
    """``(logprobs [N, k], ids [N, k])`` (:func:`dflash_kernels.lm_head_topk`)."""
    if backend == "triton":
        return _ops().lm_head_topk(hidden, weight, k, norm_weight, positions, eps, False, None, softcap)
    return _ref.lm_head_topk(hidden, weight, k, norm_weight=norm_weight, eps=eps, positions=positions,
                             check_bounds=False, softcap=softcap)


def lm_head_sample_static(hidden, weight, temperature: float, seed: torch.Tensor, *, norm_weight=None, eps=1e-6,
                          positions=None, softcap=None, backend: str = "reference") -> torch.Tensor:
    """A sample per row from ``softmax(z / T)``, noise keyed by the device tensor ``seed [1]``."""
    if backend == "triton":
        return _ops().lm_head_sample_static(hidden, weight, float(temperature), seed, norm_weight, positions, eps,
                                            None, softcap)
    return _ref.lm_head_sample_static(hidden, weight, temperature, seed, norm_weight=norm_weight, eps=eps,
                                      positions=positions, check_bounds=False, softcap=softcap)


def lm_head_sample_processed_static(hidden, weight, temperature: float, seed: torch.Tensor, *, top_k=None,
                                    top_p=None, min_p=None, norm_weight=None, eps=1e-6, positions=None,
                                    softcap=None, backend: str = "reference") -> torch.Tensor:
    """A sample per row from the processed distribution (top-k / top-p / min-p), keyed by ``seed [1]``."""
    if backend == "triton":
        return _ops().lm_head_sample_processed_static(hidden, weight, float(temperature), top_k, top_p, min_p,
                                                      seed, norm_weight, positions, eps, None, softcap)
    return _ref.lm_head_sample_processed_static(hidden, weight, temperature, seed, top_k=top_k, top_p=top_p,
                                                min_p=min_p, norm_weight=norm_weight, eps=eps, positions=positions,
                                                check_bounds=False, softcap=softcap)


# The tree ops' torch implementations are fixed-shape tensor code without host reads: on the reference
# backend they are traced inline (inductor fuses the ~60 small ops of a build + bits + walk into a few
# loops: ~85 us a round on one CPU thread, against ~870 us through the opaque ops).

@torch.library.custom_op("dflash::build_tree_device_static", mutates_args=())
def _build_tree_device_static(top_logprobs: torch.Tensor, top_ids: torch.Tensor, budget: int, slots: torch.Tensor,
                              ranks: torch.Tensor, depth_of: torch.Tensor,
                              parent_base: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`dflash_kernels.build_tree_device` over index tables the caller holds (the tensors of a
    :class:`~dflash_kernels.tree_device.TreeTables`; its host ints follow from the shapes and ``budget``)."""
    D, K = top_logprobs.shape
    n = _tree_device.tree_size(D, K, budget)
    prefix, kept = _tree_device._host_layout(n, K, D)
    tables = _tree_device.TreeTables(n, K, D, prefix, kept, slots, ranks, depth_of, parent_base)
    return _tree_device.build_tree_device(top_logprobs, top_ids, budget, tables=tables)


@_build_tree_device_static.register_fake
def _build_tree_device_static_fake(top_logprobs, top_ids, budget, slots, ranks, depth_of, parent_base):
    depth, k = top_logprobs.shape  # concrete ints (a symbolic one is specialized): the tree size is static
    n = _tree_device.tree_size(int(depth), int(k), int(budget))
    new = lambda size: top_logprobs.new_empty(size, dtype=torch.int64)  # noqa: E731
    return new(n), new(n), new(n + 1)


def build_tree_device(logprobs, ids, budget: int, *, tables=None, backend: str = "reference"):
    """``(tokens [N], depths [N], parents [N+1])`` (:func:`dflash_kernels.build_tree_device`).

    ``tables``: the build's :class:`~dflash_kernels.tree_device.TreeTables`, held by the caller (a compiled
    round holds them as long as its graphs, which read their addresses); made per call when omitted."""
    if backend == "triton":
        if tables is None:
            return _ops().build_tree_device(logprobs, ids, budget)
        return torch.ops.dflash.build_tree_device_static(logprobs, ids, budget, tables.slots, tables.ranks,
                                                         tables.depth_of, tables.parent_base)
    return _tree_device.build_tree_device(logprobs, ids, budget, tables=tables)


def ancestor_bits(parents, *, backend: str = "reference") -> torch.Tensor:
    """``[N+1, W]`` int32 ancestor-or-self bits of a parent array from our own tree build (unchecked)."""
    if backend == "triton":
        return _ops().ancestor_bits(parents, False)
    return _ref.ancestor_bits_doubling(parents)


def walk_tree_device(parents, tokens, choices, max_depth: int, bits=None, *, backend: str = "reference"):
    """``(path [D+1], path_len [1], committed [D+1])`` (:func:`dflash_kernels.walk_tree_device`)."""
    if backend == "triton":
        return _ops().walk_tree_device(parents, tokens, choices, max_depth, bits)
    return _tree_device.walk_tree_device(parents, tokens, choices, max_depth, bits)


def compact_kv_static_(kv, src_rows, dst_start, num_rows, *, backend: str = "reference") -> torch.Tensor:
    """Move rows ``src_rows[i]`` of every layer to ``dst_start + i`` for ``i < num_rows`` (all device tensors).

    The custom op on every backend: the traced index math on the cache would be functionalized into a copy
    of the whole cache (see :func:`kv_write_`)."""
    _ops().compact_kv_static_(kv, src_rows, dst_start, num_rows)
    return kv
