"""Registers every op of the package: ``torch.ops.dflash.<name>``.

Each kernel module declares its own ops beside its kernels (:func:`dflash_kernels._declare.declare`: the
schema from the signature, the mutated arguments, the shape rule that is the fake, the autograd; the
constraints every declaration keeps are listed there), so importing this module imports them all; the fakes
of the C++ ops sit beside their Python faces (``kv_write_``: :mod:`dflash_kernels.kv_compaction`;
``philox_uint32``: :mod:`dflash_kernels.noise`). What it holds itself: the tree structure ops, declared the
same way.

One op name per public op. Where a public op takes an int or a tensor for a per-round value, the two schemas
are two overloads of that name (as aten's ``add.Tensor`` / ``add.Scalar``): ``.default`` with the int,
``.tensor`` with an int64 device tensor ``[1]`` read in-kernel (a compiled / CUDA-graph step, where no Python
value may change from round to round):

* ``tree_attention.tensor``: the committed length (``[b]``: one per batch row), K/V the whole cache views;
* ``lm_head_sample.tensor``: the seed (the noise a pure function of its value);
* ``compact_kv_.tensor``: the first destination row (unchecked); also the batched form (a 6-D ``kv [b, ...]``
  with per-row ``[b]`` destinations and counts: the schema fixes no shape);
* ``build_tree_device.tables``: the device build over index tables the round owns (the tensors of a
  :class:`~dflash_kernels.tree_device.TreeTables`);
* ``gather_concat.into``: ``gather_concat(out=...)``, writing ``out``.
* ``walk_tree.padded``: ``walk_tree(.., max_depth)``, the walk of one tree or of a batch ``[b, N+1]`` padded
  to ``D + 1`` (static shapes; ``.default`` is the unpadded walk of one tree).

``lm_head_sample_processed`` and ``rejection_sample`` have only the tensor-seed schema (an int seed or a
generator draws its noise on the host). Mutated arguments: ``compact_kv_`` writes ``kv``,
``gather_concat.into`` ``out``, ``gated_delta_replay_`` ``state``, ``gated_delta_tree`` its ``scratch``, the
C++ ``kv_write_`` (csrc/kv_write.cpp) ``kv``. Backwards: ``lm_head_cross_entropy`` (through
``lm_head_cross_entropy_backward``) and ``dynamic_conv`` (through ``dynamic_conv_backward``).

Differences from the public signatures, where the schema cannot express theirs: ``positions`` / ``rows`` must
be tensors (not Python lists); the samplers take a seed (no ``torch.Generator`` in a schema); ``walk_tree``
returns its bonus token as a 0-d int64 CPU tensor instead of a Python int; the mutating ops return nothing.

Output sizes: every op's output shape follows from input shapes and ints, including the C++ ``build_tree``
(its heap pops the whole tree before it runs dry, so ``N = tree_size(D, K, budget)`` always), except
``walk_tree`` (the C++ walk's accepted path length is data-dependent): its fake gives the path an unbacked size
from ``torch.library.get_ctx().new_dynamic_size()``. It is a host op (CPU results, a device-to-host copy for GPU
inputs), as is ``build_tree``; the round on the device uses ``build_tree_device`` / ``walk_tree_device``, whose
shapes are static.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor

# the modules that declare their ops beside their kernels
from . import (cross_entropy, dynamic_conv, gated_delta, gather, kv_compaction, lm_head,  # noqa: F401
               noise, rejection, sampling, selector, tree_attention)
from . import tree as _tree
from . import tree_device as _tree_device
from ._declare import declare

__all__: list = []  # the ops live in torch.ops.dflash


# --------------------------------------------------------------------------- tree structure


@declare("ancestor_bits",
         fake=lambda a: a.parents.new_empty(*a.parents.shape, (a.parents.shape[-1] + 31) // 32, dtype=torch.int32))
def ancestor_bits(parents: Tensor, check: bool = True) -> Tensor:
    """:func:`dflash_kernels.ancestor_bits`: int32 ``[(b,) N+1, ceil((N+1)/32)]`` on parents' device."""
    return _tree.ancestor_bits(parents, check=check)


@declare("tree_positions", fake=lambda a: a.depths.new_empty(a.depths.shape[0] + 1, dtype=torch.int64))
def tree_positions(depths: Tensor, start: int) -> Tensor:
    """:func:`dflash_kernels.tree_positions`: int64 ``[N+1]`` positions of ``[root, nodes...]``."""
    return _tree.tree_positions(depths, start)


def _static_tree_size(top_logprobs: Tensor, budget) -> int:
    """``tree_size(D, K, budget)`` from the draft's shape ``[(b,) D, K]`` (concrete ints: a symbolic one is
    specialized)."""
    depth, k = top_logprobs.shape[-2:]
    return _tree_device.tree_size(int(depth), int(k), int(budget))


def _tree_fake(lead, n: int, device, score_dtype):
    """The outputs of a tree build: ``(token_ids [.., N], depths [.., N], parents [.., N+1])`` int64 and ``scores
    [.., N]``, ``lead`` the batch dims."""
    new = lambda size, dtype=torch.int64: torch.empty(*lead, size, dtype=dtype, device=device)  # noqa: E731
    return new(n), new(n), new(n + 1), new(n, score_dtype)


def _device_tree_fake(draft: Tensor, budget) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """The outputs of a device tree build from a draft ``[(b,) D, K]`` (``top_logprobs`` or ``candidates``):
    :func:`_tree_fake` with ``N = tree_size(D, K, budget)``, float32 scores on the draft's device."""
    return _tree_fake(draft.shape[:-2], _static_tree_size(draft, budget), draft.device, torch.float32)


@declare("build_tree", fake=lambda a: _tree_fake(a.top_logprobs.shape[:-2],
                                                 _static_tree_size(a.top_logprobs, a.budget), "cpu", torch.float64))
def build_tree(top_logprobs: Tensor, top_ids: Tensor, budget: int) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """:func:`dflash_kernels.build_tree` on the host (C++ heap): ``(token_ids [.., N], depths [.., N], parents
    [.., N+1])`` int64 and ``scores [.., N]`` float64 on the CPU. ``N = tree_size(D, K, budget)``: the heap pushes
    a node's next sibling and first child at every pop, so it empties only after the whole ``D``-level tree was
    popped; the fake is static."""
    return _tree.build_tree(top_logprobs, top_ids, budget)


def _walked_fake(parents: Tensor, max_depth: int, device) -> Tuple[Tensor, Tensor, Tensor]:
    """The padded walks' outputs: ``(path [(b,) D+1], path_len [1] or [b], committed [(b,) D+1])`` int64."""
    lead = tuple(parents.shape[:-1])
    new = lambda *size: torch.empty(*size, dtype=torch.int64, device=device)  # noqa: E731
    return new(*lead, max_depth + 1), new(*lead) if lead else new(1), new(*lead, max_depth + 1)


def _walk_tree_fake(a) -> Tuple[Tensor, Tensor]:
    length = torch.library.get_ctx().new_dynamic_size(min=1)
    return torch.empty(length, dtype=torch.int64, device="cpu"), torch.empty((), dtype=torch.int64, device="cpu")


@declare("walk_tree", fake=_walk_tree_fake)
def walk_tree(parents: Tensor, token_ids: Tensor, target_choice: Tensor) -> Tuple[Tensor, Tensor]:
    """:func:`dflash_kernels.walk_tree` (C++, host op): ``(accepted [M] int64, bonus [] int64)``, both on
    the CPU; the bonus token is a 0-d tensor where the public function returns an int. ``M`` (1..D+1)
    depends on the values: the fake gives it an unbacked size (``new_dynamic_size(min=1)``)."""
    accepted, bonus = _tree.walk_tree(parents, token_ids, target_choice)
    return accepted, torch.tensor(bonus, dtype=torch.int64)


@declare("walk_tree.padded", fake=lambda a: _walked_fake(a.parents, a.max_depth, "cpu"))
def walk_tree_padded(parents: Tensor, token_ids: Tensor, target_choice: Tensor,
                     max_depth: int) -> Tuple[Tensor, Tensor, Tensor]:
    """:func:`dflash_kernels.walk_tree` with ``max_depth`` (C++, host op, one call for a batch): ``(path [(b,)
    D+1], path_len [1] or [b], committed [(b,) D+1])`` int64 on the CPU, padded with 0."""
    return _tree.walk_tree(parents, token_ids, target_choice, max_depth)


@declare("build_tree_device", fake=lambda a: _device_tree_fake(a.top_logprobs, a.budget))
def build_tree_device(top_logprobs: Tensor, top_ids: Tensor, budget: int) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """:func:`dflash_kernels.build_tree` on the device (``on_device=True``): ``(token_ids [.., N], depths [.., N],
    parents [.., N+1])`` int64 and ``scores [.., N]`` float32 on the inputs' device, ``N = tree_size(D, K,
    budget)``."""
    return _tree_device.build_tree_device(top_logprobs, top_ids, budget)


@declare("build_selector_tree_device", fake=lambda a: _device_tree_fake(a.candidates, a.budget))
def build_selector_tree_device(child_logprobs: Tensor, candidates: Tensor,
                               budget: int) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """:func:`dflash_kernels.build_selector_tree_device`: ``(token_ids [.., N], depths [.., N], parents [.., N+1])``
    int64 and ``scores [.., N]`` float32 on the inputs' device, ``N = tree_size(D, k, budget)`` for candidates
    ``[(b,) D, k]``."""
    return _tree_device.build_selector_tree_device(child_logprobs, candidates, budget)


@declare("build_tree_device.tables", fake=lambda a: _device_tree_fake(a.top_logprobs, a.budget))
def build_tree_device_tables(top_logprobs: Tensor, top_ids: Tensor, budget: int, slots: Tensor, ranks: Tensor,
                             depth_of: Tensor, parent_base: Tensor) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """:func:`dflash_kernels.build_tree` on the device over index tables the caller holds (the tensors of a
    :class:`~dflash_kernels.tree_device.TreeTables`; its host ints follow from the shapes and ``budget``)."""
    D, K = top_logprobs.shape[-2:]
    n = _tree_device.tree_size(D, K, budget)
    prefix, kept = _tree_device._host_layout(n, K, D)
    tables = _tree_device.TreeTables(n, K, D, prefix, kept, slots, ranks, depth_of, parent_base)
    return _tree_device.build_tree_device(top_logprobs, top_ids, budget, tables=tables)


@declare("walk_tree_device", fake=lambda a: _walked_fake(a.parents, a.max_depth, a.parents.device))
def walk_tree_device(parents: Tensor, token_ids: Tensor, target_choice: Tensor, max_depth: int,
                     bits: Optional[Tensor] = None) -> Tuple[Tensor, Tensor, Tensor]:
    """:func:`dflash_kernels.walk_tree_device`: ``(path [(b,) D+1], path_len [1] or [b], committed [(b,) D+1])``
    int64."""
    return _tree.walk_tree_triton(parents, token_ids, target_choice, max_depth, bits)
