"""The training loss at the head, the spec of :func:`dflash_kernels.lm_head_cross_entropy`:
``weights * (logsumexp(logits) - logits[target])`` per row of the head's logits
(:mod:`dflash_kernels.reference.lm_head`), 0 where ``target == ignore_index``, differentiable wrt ``hidden``
only (``weight``, ``norm_weight`` and ``weights`` are constants).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .lm_head import _logits, check_targets, head_inputs

__all__ = ["lm_head_cross_entropy"]


def lm_head_cross_entropy(hidden, weight, targets, *, weights=None, norm_weight=None, eps=1e-6, positions=None,
                          ignore_index=-100, check_bounds=True, softcap=None) -> torch.Tensor:
    """fp32 ``[N]`` per-row losses ``weights * (logsumexp(logits) - logits[target])``; 0 at ``ignore_index``.

    Differentiable wrt ``hidden`` only (``weight``, ``norm_weight`` and the loss
    ``weights`` are detached); with ``softcap`` the logits are capped first
    and autograd goes through the tanh.
    """
    head = head_inputs(hidden, weight, norm_weight, eps, positions, softcap, check_bounds=check_bounds)
    targets, weights = check_targets(targets, weights, head.rows, head.vocab, hidden.device, ignore_index)
    logits = _logits(head)
    loss = F.cross_entropy(logits, targets, reduction="none", ignore_index=ignore_index)
    if weights is not None:
        loss = loss * weights.detach().float()
    return loss
