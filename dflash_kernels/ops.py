"""Every ``torch.library`` registration of the package: ``torch.ops.dflash.<name>``.

The public ops (:mod:`dflash_kernels`) run their Triton launchers directly in
eager mode; while ``torch.compile`` traces them (on the Triton backend) they
call the custom op of the same name registered here, whose implementation is
the public function again (same validation, same backend choice as
:func:`dflash_kernels.get_backend` makes at run time). For each op this module
holds what ``torch.compile`` needs to trace a call without looking inside it:

* a fake (meta) implementation giving the output shapes, dtypes and devices
  from the input shapes alone (``register_fake``);
* the mutated arguments in the schema (``mutates_args``): ``compact_kv_``
  writes ``kv``, ``gather_concat.into`` writes ``out``,
  ``gated_delta_replay_`` ``state``, ``gated_delta_tree`` its ``scratch``,
  the C++ ``kv_write_`` (csrc/kv_write.cpp) ``kv``. The in-place ops return
  nothing (``-> ()``), the one form of a mutating custom op that every
  supported torch registers (tagged in-place / ``out=`` ops that return their
  mutated input, and keyword-only tensor arguments, exist only from torch
  2.13), so their fakes return None too and callers keep their own reference
  to the buffer; a mutated argument is never defaulted (torch before 2.13
  bumps its version counter by position);
* a backward for ``lm_head_cross_entropy`` (``register_autograd``): the
  gradient with respect to ``hidden`` through the row gather and the final
  norm, ``weight`` / ``norm_weight`` / the loss ``weights`` frozen, as the
  public function's autograd does;
* a backward for ``dynamic_conv`` (``register_autograd``): the gradients of
  every tensor input through the op ``dynamic_conv_backward`` (one Triton
  launch, or the torch math of
  :func:`dflash_kernels.reference.dynamic_conv_backward`). The public
  function routes a call that needs gradients through the custom op, so the
  Triton forward trains.

One op name per public op. Where a public op takes an int or a tensor for a
per-round value, the two schemas are two overloads of that name (as aten's
``add.Tensor`` / ``add.Scalar``): ``.default`` with the int, ``.tensor`` with
an int64 device tensor ``[1]`` read in-kernel (a compiled / CUDA-graph step,
where no Python value may change from round to round):

* ``tree_attention.tensor``: the committed length (``[b]``: one per batch row), K/V the whole cache views;
* ``lm_head_sample.tensor``: the seed (the noise a pure function of its value);
* ``compact_kv_.tensor``: the first destination row (unchecked); also the
  batched form (a 6-D ``kv [b, ...]`` with per-row ``[b]`` destinations and
  counts: the schema fixes no shape);
* ``build_tree_device.tables``: the device build over index tables the round
  owns (the tensors of a :class:`~dflash_kernels.tree_device.TreeTables`);
* ``gather_concat.into``: ``gather_concat(out=...)``, writing ``out``.

``lm_head_sample_processed`` and ``rejection_sample`` have only the
tensor-seed schema (an int seed or a generator draws its noise on the host).

Why ``custom_op`` and not ``triton_op``: ``triton_op`` traces its Python body
under ``torch.compile`` with fake tensors, and the launchers read host values
of their inputs (``gather_concat``'s pointer table of ``data_ptr()`` s, the
lm_head's vocab chunk loops, the debug checks) and launch kernels directly
rather than through ``torch.library.wrap_triton``. A ``custom_op`` is opaque
to the compiler: the graph holds one node per call and the launcher runs at
run time.

Schema types: Python ints are ``SymInt``, floats ``float``, optional tensors
``Tensor?``, ``gather_concat``'s layers ``Tensor[]``, dtypes ``ScalarType``.
Differences from the public signatures, where the schema cannot express
theirs: ``positions`` / ``rows`` must be tensors (not Python lists); the
samplers take a seed (no ``torch.Generator`` in a schema); ``walk_tree``
returns its bonus token as a 0-d int64 CPU tensor instead of a Python int;
the mutating ops return nothing.

Output sizes: every op's output shape follows from input shapes and ints,
including the C++ ``build_tree`` (its heap pops the whole tree before it runs
dry, so ``N = tree_size(D, K, budget)`` always), except ``walk_tree`` (the C++
walk's accepted path length is data-dependent): its fake gives the path an
unbacked size from ``torch.library.get_ctx().new_dynamic_size()``. It is a
host op (CPU results, a device-to-host copy for GPU inputs), as is
``build_tree``; the round on the device uses ``build_tree_device`` /
``walk_tree_device``, whose shapes are static.
"""

from __future__ import annotations

from typing import List, Optional, Tuple

import torch
from torch import Tensor

from . import _C  # noqa: F401  (the C++ ops: dflash::kv_write_, dflash::philox_uint32)
from . import cross_entropy, gather, kv_compaction, lm_head, rejection, sampling  # noqa: F401  (declare their ops)
from . import gated_delta as _gd
from . import tree as _tree
from . import tree_device as _tree_device
from .dynamic_conv import _forward as _dynamic_conv_forward
from .dynamic_conv import dynamic_conv_backward as _dynamic_conv_backward
from .selector import select_candidates as _select_candidates
# (not ``from . import tree_attention``: the package attribute of that name is the function)
from .tree_attention import tree_attention as _tree_attention

__all__: list = []  # the ops live in torch.ops.dflash

_NS = "dflash"


def _rows(positions: Optional[Tensor], hidden: Tensor):
    """Selected row count: ``positions``' length, else every row of ``hidden``."""
    return hidden.shape[0] if positions is None else positions.shape[0]


# --------------------------------------------------------------------------- tree structure


@torch.library.custom_op(f"{_NS}::ancestor_bits", mutates_args=())
def ancestor_bits(parents: Tensor, check: bool = True) -> Tensor:
    """:func:`dflash_kernels.ancestor_bits`: int32 ``[N+1, ceil((N+1)/32)]`` on parents' device."""
    return _tree.ancestor_bits(parents, check=check)


@ancestor_bits.register_fake
def _ancestor_bits_fake(parents, check=True):
    n = parents.shape[0]
    return parents.new_empty(n, (n + 31) // 32, dtype=torch.int32)


@torch.library.custom_op(f"{_NS}::tree_positions", mutates_args=())
def tree_positions(depths: Tensor, start: int) -> Tensor:
    """:func:`dflash_kernels.tree_positions`: int64 ``[N+1]`` positions of ``[root, nodes...]``."""
    return _tree.tree_positions(depths, start)


@tree_positions.register_fake
def _tree_positions_fake(depths, start):
    return depths.new_empty(depths.shape[0] + 1, dtype=torch.int64)


def _static_tree_size(top_logprobs: Tensor, budget) -> int:
    """``tree_size(D, K, budget)`` from the draft's shape (concrete ints: a symbolic one is specialized)."""
    depth, k = top_logprobs.shape
    return _tree_device.tree_size(int(depth), int(k), int(budget))


@torch.library.custom_op(f"{_NS}::build_tree", mutates_args=())
def build_tree(top_logprobs: Tensor, top_ids: Tensor, budget: int) -> Tuple[Tensor, Tensor, Tensor]:
    """:func:`dflash_kernels.build_tree` (C++ heap, host op): ``(token_ids [N], depths [N], parents [N+1])``
    int64 on the CPU. ``N = tree_size(D, K, budget)``: the heap pushes a node's next sibling and first child
    at every pop, so it empties only after the whole ``D``-level tree was popped; the fake is static."""
    return _tree.build_tree(top_logprobs, top_ids, budget)


@build_tree.register_fake
def _build_tree_fake(top_logprobs, top_ids, budget):
    n = _static_tree_size(top_logprobs, budget)
    new = lambda size: torch.empty(size, dtype=torch.int64, device="cpu")  # noqa: E731
    return new(n), new(n), new(n + 1)


@torch.library.custom_op(f"{_NS}::walk_tree", mutates_args=())
def walk_tree(parents: Tensor, token_ids: Tensor, target_choice: Tensor) -> Tuple[Tensor, Tensor]:
    """:func:`dflash_kernels.walk_tree` (C++, host op): ``(accepted [M] int64, bonus [] int64)``, both on
    the CPU; the bonus token is a 0-d tensor where the public function returns an int. ``M`` (1..D+1)
    depends on the values: the fake gives it an unbacked size (``new_dynamic_size(min=1)``)."""
    accepted, bonus = _tree.walk_tree(parents, token_ids, target_choice)
    return accepted, torch.tensor(bonus, dtype=torch.int64)


@walk_tree.register_fake
def _walk_tree_fake(parents, token_ids, target_choice):
    length = torch.library.get_ctx().new_dynamic_size(min=1)
    return (torch.empty(length, dtype=torch.int64, device="cpu"), torch.empty((), dtype=torch.int64, device="cpu"))


@torch.library.custom_op(f"{_NS}::build_tree_device", mutates_args=())
def build_tree_device(top_logprobs: Tensor, top_ids: Tensor, budget: int) -> Tuple[Tensor, Tensor, Tensor]:
    """:func:`dflash_kernels.build_tree_device`: ``(token_ids [N], depths [N], parents [N+1])`` int64 on
    the inputs' device, ``N = tree_size(D, K, budget)``."""
    return _tree_device.build_tree_device(top_logprobs, top_ids, budget)


@build_tree_device.register_fake
def _build_tree_device_fake(top_logprobs, top_ids, budget):
    n = _static_tree_size(top_logprobs, budget)
    new = lambda size: top_logprobs.new_empty(size, dtype=torch.int64)  # noqa: E731
    return new(n), new(n), new(n + 1)


@torch.library.custom_op(f"{_NS}::build_selector_tree_device", mutates_args=())
def build_selector_tree_device(child_logprobs: Tensor, candidates: Tensor, budget: int) -> Tuple[Tensor, Tensor, Tensor]:
    """:func:`dflash_kernels.build_selector_tree_device`: ``(token_ids [N], depths [N], parents [N+1])`` int64 on
    the inputs' device, ``N = tree_size(D, k, budget)`` for ``candidates [D, k]``."""
    return _tree_device.build_selector_tree_device(child_logprobs, candidates, budget)


@build_selector_tree_device.register_fake
def _build_selector_tree_device_fake(child_logprobs, candidates, budget):
    n = _static_tree_size(candidates, budget)
    new = lambda size: candidates.new_empty(size, dtype=torch.int64)  # noqa: E731
    return new(n), new(n), new(n + 1)


@torch.library.custom_op(f"{_NS}::build_tree_device.tables", mutates_args=())
def build_tree_device_tables(top_logprobs: Tensor, top_ids: Tensor, budget: int, slots: Tensor, ranks: Tensor,
                             depth_of: Tensor, parent_base: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
    """:func:`dflash_kernels.build_tree_device` over index tables the caller holds (the tensors of a
    :class:`~dflash_kernels.tree_device.TreeTables`; its host ints follow from the shapes and ``budget``)."""
    D, K = top_logprobs.shape
    n = _tree_device.tree_size(D, K, budget)
    prefix, kept = _tree_device._host_layout(n, K, D)
    tables = _tree_device.TreeTables(n, K, D, prefix, kept, slots, ranks, depth_of, parent_base)
    return _tree_device.build_tree_device(top_logprobs, top_ids, budget, tables=tables)


@build_tree_device_tables.register_fake
def _build_tree_device_tables_fake(top_logprobs, top_ids, budget, slots, ranks, depth_of, parent_base):
    n = _static_tree_size(top_logprobs, budget)
    new = lambda size: top_logprobs.new_empty(size, dtype=torch.int64)  # noqa: E731
    return new(n), new(n), new(n + 1)


@torch.library.custom_op(f"{_NS}::walk_tree_device", mutates_args=())
def walk_tree_device(parents: Tensor, token_ids: Tensor, target_choice: Tensor, max_depth: int,
                     bits: Optional[Tensor] = None) -> Tuple[Tensor, Tensor, Tensor]:
    """:func:`dflash_kernels.walk_tree_device`: ``(path [D+1], path_len [1], committed [D+1])`` int64."""
    return _tree_device.walk_tree_device(parents, token_ids, target_choice, max_depth, bits)


@walk_tree_device.register_fake
def _walk_tree_device_fake(parents, token_ids, target_choice, max_depth, bits=None):
    new = lambda size: parents.new_empty(size, dtype=torch.int64)  # noqa: E731
    return new(max_depth + 1), new(1), new(max_depth + 1)


# --------------------------------------------------------------------------- attention


@torch.library.custom_op(f"{_NS}::tree_attention", mutates_args=())
def tree_attention(query: Tensor, key: Tensor, value: Tensor, bits: Optional[Tensor], prefix_len: int,
                   scale: Optional[float] = None, positions: Optional[Tensor] = None, window: Optional[int] = None,
                   softcap: Optional[float] = None, sinks: Optional[Tensor] = None) -> Tensor:
    """:func:`dflash_kernels.tree_attention`: query-shaped output in the query's dtype (``[Hq, T, D]`` or
    ``[b, Hq, T, D]`` for a batch of ``b`` rows; K/V any strides, e.g. views of the cache: read, never copied or
    written)."""
    return _tree_attention(query, key, value, bits, prefix_len, scale, positions=positions, window=window,
                                softcap=softcap, sinks=sinks)


@tree_attention.register_fake
def _tree_attention_fake(query, key, value, bits, prefix_len, scale=None, positions=None, window=None,
                         softcap=None, sinks=None):
    return query.new_empty(query.shape)


@torch.library.custom_op(f"{_NS}::tree_attention.tensor", mutates_args=())
def tree_attention_tensor(query: Tensor, key: Tensor, value: Tensor, bits: Optional[Tensor], prefix_len: Tensor,
                          scale: Optional[float] = None, positions: Optional[Tensor] = None,
                          window: Optional[int] = None, softcap: Optional[float] = None,
                          sinks: Optional[Tensor] = None) -> Tensor:
    """:func:`dflash_kernels.tree_attention` with the committed lengths ``prefix_len`` an int64 device tensor
    ``[b]`` (``[1]`` / ``[]`` for one row; read in-kernel), K/V the whole cache views ``[b, Hkv, S_max, D]``
    (or ``[Hkv, S_max, D]``); query-shaped output."""
    return _tree_attention(query, key, value, bits, prefix_len, scale, positions=positions, window=window,
                                  softcap=softcap, sinks=sinks)


@tree_attention_tensor.register_fake
def _tree_attention_tensor_fake(query, key, value, bits, prefix_len, scale=None, positions=None, window=None,
                                softcap=None, sinks=None):
    return query.new_empty(query.shape)


@torch.library.register_fake("dflash::philox_uint32")
def _philox_uint32_fake(seed, rows, cols):
    """The C++ op of csrc/philox.cpp: int64 ``[R, C]`` words."""
    return rows.new_empty((rows.shape[0], cols.shape[0]), dtype=torch.int64)


# --------------------------------------------------------------------------- Gated-DeltaNet
#
# ``gated_delta_tree``: ``[N, Hv, Dv]`` in ``v``'s dtype; writes ``scratch`` when one is passed
# (``parents`` and ``scratch`` required positional arguments, None allowed). ``gated_delta_replay_``:
# advances ``state`` in place. ``causal_conv_tree``: ``[N, C]`` in ``x``'s dtype. ``conv_window_after``:
# a new ``window``-shaped tensor. The row count of a replay stays on the device: no unbacked sizes.


@torch.library.custom_op(f"{_NS}::gated_delta_tree", mutates_args={"scratch"})
def gated_delta_tree(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor,
                     parents: Optional[Tensor], scratch: Optional[Tensor], scale: Optional[float] = None,
                     qk_l2norm: bool = True, store_states: str = "all", check: bool = False) -> Tensor:
    """:func:`dflash_kernels.gated_delta_tree`: ``[N, Hv, Dv]`` outputs in ``v``'s dtype (``scratch`` written).

    ``parents`` and ``scratch`` are required (either may be None): a mutated argument must always be
    passed, since torch before 2.13 bumps its version counter by position and fails on a defaulted one."""
    return _gd.gated_delta_tree(q, k, v, g, beta, state, parents, scale=scale, qk_l2norm=qk_l2norm,
                                scratch=scratch, store_states=store_states, check=check)


@gated_delta_tree.register_fake
def _gated_delta_tree_fake(q, k, v, g, beta, state, parents, scratch, scale=None, qk_l2norm=True,
                           store_states="all", check=False):
    return v.new_empty(v.shape)


@torch.library.custom_op(f"{_NS}::gated_delta_replay_", mutates_args={"state"})
def gated_delta_replay_(state: Tensor, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, rows: Tensor,
                        num_rows: Tensor, scale: Optional[float] = None, qk_l2norm: bool = True,
                        check: bool = False) -> None:
    """:func:`dflash_kernels.gated_delta_replay_`: ``state`` advanced in place through the accepted rows."""
    _gd.gated_delta_replay_(state, q, k, v, g, beta, rows, num_rows, scale=scale, qk_l2norm=qk_l2norm, check=check)


@gated_delta_replay_.register_fake
def _gated_delta_replay_fake(state, q, k, v, g, beta, rows, num_rows, scale=None, qk_l2norm=True, check=False):
    return None


@torch.library.custom_op(f"{_NS}::causal_conv_tree", mutates_args=())
def causal_conv_tree(x: Tensor, window: Tensor, weight: Tensor, parents: Optional[Tensor] = None,
                     bias: Optional[Tensor] = None, activation: Optional[str] = "silu", check: bool = False) -> Tensor:
    """:func:`dflash_kernels.causal_conv_tree`: ``[N, C]`` in ``x``'s dtype."""
    return _gd.causal_conv_tree(x, window, weight, parents, bias=bias, activation=activation, check=check)


@causal_conv_tree.register_fake
def _causal_conv_tree_fake(x, window, weight, parents=None, bias=None, activation="silu", check=False):
    return x.new_empty(x.shape)


@torch.library.custom_op(f"{_NS}::conv_window_after", mutates_args=())
def conv_window_after(window: Tensor, x: Tensor, rows: Tensor, num_rows: Tensor) -> Tensor:
    """:func:`dflash_kernels.conv_window_after`: a new ``[K-1, C]`` (``[L, K-1, C]``) window."""
    return _gd.conv_window_after(window, x, rows, num_rows)


@conv_window_after.register_fake
def _conv_window_after_fake(window, x, rows, num_rows):
    return window.new_empty(window.shape)


# --------------------------------------------------------------------------- DFlash2
#
# ``dynamic_conv``: a new contiguous ``[nb, B, H]`` in ``x``'s dtype (``dynamic`` read through its strides), with
# a backward. ``select_candidates``: ``(tokens int64, index int64, q fp32)`` shaped like ``unary`` minus / plus
# its last dimension; ``seed`` (int64 ``[1]``) is required when ``temperature > 0``; no backward.


@torch.library.custom_op(f"{_NS}::dynamic_conv", mutates_args=())
def dynamic_conv(x: Tensor, dynamic: Tensor, base: Tensor, residual: Optional[Tensor] = None) -> Tensor:
    """:func:`dflash_kernels.dynamic_conv`: ``residual + conv(x, dynamic, base)`` ``[nb, B, H]`` in x's dtype,
    on :func:`dflash_kernels.get_backend` of x's device."""
    from ._dispatch import get_backend

    return _dynamic_conv_forward(x.detach(), dynamic.detach(), base.detach(),
                                 None if residual is None else residual.detach(), get_backend(x.device))


@dynamic_conv.register_fake
def _dynamic_conv_fake(x, dynamic, base, residual=None):
    return x.new_empty(x.shape)


@torch.library.custom_op(f"{_NS}::dynamic_conv_backward", mutates_args=())
def dynamic_conv_backward(grad: Tensor, x: Tensor, dynamic: Tensor, base: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
    """:func:`dflash_kernels.dynamic_conv.dynamic_conv_backward`: ``(dx [nb, B, H], ddynamic [nb, B, K, G]
    (contiguous), dbase [K, H])`` in the inputs' dtypes (one Triton launch where the group size allows)."""
    from ._dispatch import get_backend

    dx, dd, db, _ = _dynamic_conv_backward(grad, x, dynamic, base, (True, True, True, False),
                                           backend=get_backend(x.device))
    return dx, dd, db


@dynamic_conv_backward.register_fake
def _dynamic_conv_backward_fake(grad, x, dynamic, base):
    return x.new_empty(x.shape), dynamic.new_empty(dynamic.shape), base.new_empty(base.shape)


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


dynamic_conv.register_autograd(_dynamic_conv_grad, setup_context=_dynamic_conv_setup_context)


@torch.library.custom_op(f"{_NS}::select_candidates", mutates_args=())
def select_candidates(unary: Tensor, candidates: Tensor, projected: Tensor, predecessor: Tensor,
                      successor: Tensor, anchor: Tensor, temperature: float,
                      seed: Optional[Tensor] = None, top_k: int = 0, top_p: float = 1.0,
                      min_p: float = 0.0) -> Tuple[Tensor, Tensor, Tensor]:
    """:func:`dflash_kernels.select_candidates`: ``(tokens [.., D] int64, index [.., D] int64, q [.., D, k]
    fp32)`` (``top_k`` 0, ``top_p`` 1, ``min_p`` 0: that filter off)."""
    return _select_candidates(unary, candidates, projected, predecessor, successor, anchor, temperature, seed,
                              top_k=top_k, top_p=top_p, min_p=min_p)


@select_candidates.register_fake
def _select_candidates_fake(unary, candidates, projected, predecessor, successor, anchor, temperature, seed=None,
                            top_k=0, top_p=1.0, min_p=0.0):
    lead = unary.shape[:-1]
    return (unary.new_empty(lead, dtype=torch.int64), unary.new_empty(lead, dtype=torch.int64),
            unary.new_empty(unary.shape, dtype=torch.float32))
