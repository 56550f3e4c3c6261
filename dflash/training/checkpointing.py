"""Gradient checkpointing of the drafter's layers: activations recomputed in the backward, not stored.

Each :class:`~dflash.drafter.model.DraftLayer` keeps its inputs only;
its attention and MLP activations (``O(nb*B * (C + nb*B))`` attention
weights and ``nb*B * intermediate`` MLP rows per layer, ``nb*B`` block
queries over ``C`` context rows) are recomputed during the backward pass,
for about one more forward of the drafter. The layer's ``forward`` is
wrapped on the instance, so parameter names (and checkpoints) do not change
and FSDP2's per-layer gathering still happens around the recomputation.
"""

from __future__ import annotations

import functools

import torch
from torch.utils.checkpoint import checkpoint

__all__ = ["enable_gradient_checkpointing"]


def enable_gradient_checkpointing(draft: torch.nn.Module) -> None:
    """Recompute every layer of ``draft.layers`` in the backward (non-reentrant ``torch.utils.checkpoint``)."""
    for layer in draft.layers:
        if getattr(layer, "_dflash_checkpointed", False):
            continue
        inner = layer.forward

        @functools.wraps(inner)
        def forward(*args, _inner=inner, **kwargs):
            if not torch.is_grad_enabled():
                return _inner(*args, **kwargs)
            return checkpoint(_inner, *args, use_reentrant=False, **kwargs)

        layer.forward = forward
        layer._dflash_checkpointed = True
