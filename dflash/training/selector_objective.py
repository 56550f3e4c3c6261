"""The DFlash2 candidate selector's supervision: a teacher-forced K-way cross-entropy per drafted position.

A DFlash2 drafter (:mod:`dflash.drafter.dflash2`) proposes, at each drafted
block position ``k = 1..B-1``, one of the ``K = selector_top_k`` best tokens of
its own logits, re-scored with the previous token. Its training adds, to the
DFlash token loss of :mod:`.objective`, a cross-entropy over those ``K``
candidates (the published DFlash2 objective). For block ``b`` (anchor
``a_b``), position ``k``, final block state ``S_{b,k} [H]``, frozen lm_head
``W [V, H]`` and label ``y_{b,k}`` (the target's choice)::

    l_{b,k}   = softcap(m * W S_{b,k})                   [V]  the drafter's logits (m its output_multiplier,
                                                          softcap its final_logit_softcapping; 1 and none
                                                          by default, where l = W S)
    c_{b,k}   = top-K ids of l_{b,k}                     [K]  (no gradient through the choice)
    c'_{b,k}  = c_{b,k}, its last (weakest) slot replaced by y_{b,k} when y_{b,k} is not in c_{b,k}
    t_{b,k}   = the slot of y_{b,k} in c'_{b,k}
    prev_{b,k} = x[a_b + k - 1]                          (teacher forcing: the sequence's previous token;
                                                          k = 1: the anchor token)
    s_{b,k}[i] = l_{b,k}[c'_i] + < predecessor_codebook[prev] * hidden_projection(S_{b,k}),
                                        successor_codebook[c'_i] >          i = 0..K-1
    L_sel     = sum_{b,k>=1} w_k CE(s_{b,k}, t_{b,k})

with the DFlash position weights ``w_k`` (:func:`.objective.loss_weights`) and the
same normaliser as the token loss, so the step's loss is
``(L_tok + alpha * L_sel) / sum w`` (``alpha = --selector-loss-weight``, 1 as published).
Gradients reach the drafter's block states through both the unary scores
``l[c'_i]`` and the selector's bilinear term, and the three selector
weights through the latter; ``W`` is frozen. On data the target wrote (every
supervised token its own greedy choice) ``prev`` is the previous label.

Only ``[N, K]`` scores and ``[N, K, H]`` gathered lm_head rows are built
(``N = nb * (B-1)``); the top-K comes from :func:`dflash_kernels.lm_head_topk`,
which holds one chunk of ``[N, V]`` logits at a time.

The teacher-forced accepted length of a block is ``1 +`` the leading
positions whose best re-scored candidate is the label *and* whose label was
among the drafter's own top-K (an injected label is never proposed at
inference).
"""

from __future__ import annotations

from typing import Tuple

import torch
import torch.nn.functional as F

from ..target.head import TargetHead

__all__ = ["training_candidates", "selector_block_losses"]


def training_candidates(candidates: torch.Tensor, labels: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor,
                                                                                 torch.Tensor]:
    """``(candidates' [N, K], slot [N] int64, present [N] bool)`` for ``candidates [N, K]`` and ``labels [N]``.

    ``present``: the label is among the candidates (``slot`` its first
    position); otherwise the last slot holds the label instead and ``slot = K - 1``.
    """
    K = candidates.shape[-1]
    hit = candidates == labels[:, None]
    present = hit.any(-1)
    slot = torch.where(present, hit.int().argmax(-1), torch.full_like(labels, K - 1))
    out = candidates.clone()
    out[:, -1] = torch.where(present, candidates[:, -1], labels)
    return out, slot, present


def selector_block_losses(draft, lm_head, states: torch.Tensor, prev: torch.Tensor,
                          labels: torch.Tensor, weights: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Weighted selector cross-entropies ``[nb, B-1]`` and the teacher-forced correct drafts ``[nb, B-1]`` bool.

    ``draft``: a DFlash2 drafter (its ``candidate_selector`` is called as a
    module, so a sharded selector gathers its weights); ``states [nb*B, H]``:
    the final block states of the drafter's pass; ``prev [nb, B-1]``: the
    sequence's tokens ``x[a_b + k - 1]`` for ``k = 1..B-1`` (the anchor, then
    the block's tokens); ``labels [nb, B-1]``; ``weights [B]``; ``lm_head``: the target's
    :class:`~dflash.target.head.TargetHead` (``adapter.head``) or its weight ``[V, H]``.
    """
    nb, B = labels.shape[0], int(weights.numel())
    dev = states.device
    K = draft.candidate_selector.top_k
    rows = (torch.arange(nb, device=dev)[:, None] * B + torch.arange(1, B, device=dev)[None, :]).flatten()
    lm_head = TargetHead.of(lm_head)
    cap = draft.logit_softcap
    with torch.no_grad():  # the top-K of the drafter's logits, softcap(output_multiplier * W h)
        _, top = lm_head.topk(draft.head_hidden(states.detach()), K, positions=rows, softcap=cap)  # [N, K]
    flat_labels = labels.flatten()
    cand, slot, present = training_candidates(top, flat_labels)
    hidden = states.index_select(0, rows)  # [N, H]: the selector's projection reads the unscaled states
    head = draft.head_hidden(hidden)
    unary = lm_head.candidate_logits(head, cand, cap)  # [N, K]: their drafter logits
    scores = draft.candidate_selector(unary, hidden, prev.reshape(-1), cand).float()
    ce = F.cross_entropy(scores, slot, reduction="none") * weights[1:].to(dev).repeat(nb)
    with torch.no_grad():
        correct = (cand.gather(1, scores.argmax(-1, keepdim=True))[:, 0] == flat_labels) & present
    return ce.view(nb, B - 1), correct.view(nb, B - 1)
