"""``torch.library`` registrations of the Gated-DeltaNet ops: ``torch.ops.dflash.<name>``.

The same pattern as :mod:`dflash_kernels.ops` (kept in its own module so the
two files can change independently): each op is a
:func:`torch.library.custom_op` whose implementation calls the public
function of the same name in :mod:`dflash_kernels.gated_delta` (same
validation, same backend choice), with a fake implementation giving output
shapes from input shapes, and the mutated arguments declared in the schema:

* ``gated_delta_tree``: ``[N, Hv, Dv]`` in ``v``'s dtype; writes ``scratch``
  when one is passed (``mutates_args={"scratch"}``; ``parents`` and ``scratch``
  are required positional arguments, None allowed);
* ``gated_delta_replay_``: advances ``state`` in place, returns nothing
  (``mutates_args={"state"}``);
* ``causal_conv_tree``: ``[N, C]`` in ``x``'s dtype;
* ``conv_window_after``: a new ``window``-shaped tensor.

Every output shape follows from input shapes alone (the row count of a
replay stays on the device), so all four are traceable by ``torch.compile``
without graph breaks or unbacked sizes.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from . import gated_delta as _gd

__all__: list = []  # the ops live in torch.ops.dflash

_NS = "dflash"


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
