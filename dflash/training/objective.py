"""The block training objective of a DFlash drafter against a frozen target.

One training sequence ``x [T]`` with a loss mask, target decoder layers
``L_1..L_n`` feeding the drafter (``target_layer_ids``) and one *logit layer*
``L*`` (default: the target's last decoder layer, so that its output through
the final norm and the lm_head is exactly the target's choice):

1. Frozen target pass (no grad, eval) over ``x``, capturing ``n + 1`` layers
   (adapter capture ids ``target_layer_ids + [L*]``)::

       context  F = concat_i h_{L_i}      [T, n*H]   (what ``fc`` reads)
       logits   G = h_{L*}                [T, H]     (only for the labels)

   ``F`` never contains ``G``; optional noise goes on ``F`` only:
   ``F' = F + s * rms(F_row,layer) * N(0, 1)`` (``--context-noise s``, the RMS
   taken per row and per layer slice of width H).
2. Anchors: ``nb`` distinct positions ``a`` per sequence where a block fits
   (``1 <= a``, ``a+1..a+B-1`` inside the sequence and the loss mask; see
   :func:`dflash.training.data.valid_anchor_mask`).
3. Blocks: block ``b`` is ``[x[a_b], MASK x (B-1)]`` at positions
   ``a_b .. a_b+B-1``; embeddings from the target's (frozen) embedding.
   All blocks of a sequence go through the drafter in one pass: queries
   ``[nb*B, H]``, keys ``[context rows 0..C-1 ; all block tokens]``
   (``C = max_b a_b``), additive mask ``M [nb*B, C + nb*B]`` with
   ``M[b*B+j, p] = 0`` iff ``p < a_b`` (context strictly before the anchor:
   the anchor's own target features are not visible, as at inference, where
   the anchor token has not been through the target yet) and
   ``M[b*B+j, C+b'*B+j'] = 0`` iff ``b' == b`` (bidirectional inside the
   block, never another block); ``-inf`` (dtype min) elsewhere.
   A packed sequence (several samples end to end, ``segments``; see
   :mod:`.records`) runs one target pass per sample (positions restart at 0),
   takes its anchors inside one sample, gives every row its position inside
   its sample, and also hides the context rows of other samples:
   ``M[b*B+j, p] = 0`` iff ``s_b <= p < a_b`` with ``s_b`` the first row of
   the anchor's sample. Each block's loss is then exactly the loss it has when
   its sample is trained alone.
4. Labels: the target's greedy choice at block position ``k >= 1`` (absolute
   position ``a+k``) is its argmax after position ``a+k-1``::

       y[b, k] = argmax(lm_head(final_norm(G[a_b + k - 1])))   k = 1..B-1

   computed with the fused :func:`dflash_kernels.lm_head_argmax` at those
   ``nb*(B-1)`` rows only (final norm fused).
5. Loss: the drafter's final-normed block states ``S [nb*B, H]`` through the
   frozen target lm_head ``W [V, H]``, fused cross-entropy
   (:func:`dflash_kernels.lm_head_cross_entropy`) at rows ``k >= 1``::

       loss = sum_{b,k>=1} w_k * CE(l[b*B+k], y[b, k]) / sum_{b,k>=1} w_k
       l    = softcap(m * W S)             the drafter's logits as it drafts with them (m its
                                           output_multiplier, softcap its final_logit_softcapping;
                                           l = W S by default)
       w_k  = exp(-(k - 1) / gamma)        (k = 0, the anchor, carries no loss)

   No ``[positions, vocab]`` tensor is built beyond one chunk of the fused
   ops (on CPU without Triton the ops' reference path materializes
   ``[nb*(B-1), V]`` logits of the supervised rows only, never of the whole
   sequence).

``gamma`` defaults to :func:`default_gamma` (7 for B=16, 5 for B=10, 4 for B=8).

6. DFlash2 drafters add their selector's K-way cross-entropy at the same rows
   with the same weights (:mod:`.selector_objective`)::

       loss = sum_{b,k>=1} w_k * (CE_tok[b, k] + alpha * CE_sel[b, k]) / sum_{b,k>=1} w_k
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Callable, Dict, Optional, Sequence

import torch
import torch.nn.functional as F

from dflash_kernels.reference.lm_head import soft_cap

from ..drafter.model import DFlash2DraftModel, DFlashDraftModel
from ..target import TargetAdapter
from ..target.adapter import MASKED_PREFILL_CHUNK
from ..target.head import TargetHead
from .records import TrainingSequence, segment_starts, sequence_anchor_mask
from .selector_objective import selector_block_losses

__all__ = [
    "BlockTrainingConfig",
    "default_gamma",
    "loss_weights",
    "sample_anchors",
    "block_visibility",
    "block_attention_mask",
    "perturb_context",
    "resolve_logit_layer",
    "TargetCapture",
    "capture_target",
    "target_labels",
    "drafter_block_losses",
    "sequence_block_losses",
    "sequence_weight_sum",
    "StepLoss",
    "step_loss",
]

# --------------------------------------------------------------------------- the step's pieces


def default_gamma(block_size: int) -> float:
    """Decay of the position weights: ``B / 2`` for ``B <= 10``, then ``5 + (B - 10) / 3``.

    Piecewise linear through the published points (B=8: 4, B=10: 5, B=16: 7),
    extended along the same lines on both sides (B=4: 2, B=32: 12.33).
    """
    B = int(block_size)
    if B < 2:
        raise ValueError(f"block_size must be >= 2, got {B}")
    return B / 2.0 if B <= 10 else 5.0 + (B - 10) / 3.0


def loss_weights(block_size: int, gamma: Optional[float] = None) -> torch.Tensor:
    """fp32 ``[B]``: ``w_0 = 0`` (anchor), ``w_k = exp(-(k - 1) / gamma)`` for ``k = 1..B-1``."""
    gamma = default_gamma(block_size) if gamma is None else float(gamma)
    if not gamma > 0:
        raise ValueError(f"gamma must be > 0, got {gamma}")
    k = torch.arange(int(block_size), dtype=torch.float32)
    w = torch.exp(-(k - 1) / gamma)
    w[0] = 0.0
    return w


def sample_anchors(valid: torch.Tensor, count: int, generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """``min(count, valid.sum())`` distinct anchors drawn uniformly from ``valid [T]`` (bool), sorted."""
    candidates = valid.nonzero().flatten()
    if candidates.numel() == 0:
        raise ValueError("no valid anchor in this sequence (see dflash.training.data.valid_anchor_mask)")
    pick = torch.randperm(candidates.numel(), generator=generator)[: int(count)]
    return candidates[pick].sort().values


def block_visibility(anchors: torch.Tensor, block_size: int, context_len: int,
                     context_start: Optional[torch.Tensor] = None) -> torch.Tensor:
    """bool ``[nb*B, C + nb*B]``: which keys each block query sees.

    Query ``b*B + j`` sees context row ``p`` iff ``s_b <= p < anchors[b]`` and
    block key ``C + b'*B + j'`` iff ``b' == b``; ``s_b = context_start[b]``,
    the first row of the anchor's sample in a packed sequence (default 0).
    """
    nb, B, C = anchors.numel(), int(block_size), int(context_len)
    q_block = torch.arange(nb, device=anchors.device).repeat_interleave(B)  # [nb*B]
    p = torch.arange(C, device=anchors.device)[None, :]
    ctx = p < anchors[q_block][:, None]  # [nb*B, C]
    if context_start is not None:
        ctx &= p >= context_start.to(anchors.device)[q_block][:, None]
    blk = q_block[:, None] == q_block[None, :]  # [nb*B, nb*B]
    return torch.cat([ctx, blk], dim=1)


def block_attention_mask(anchors: torch.Tensor, block_size: int, context_len: int,
                         dtype: torch.dtype = torch.float32,
                         context_start: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Additive ``[nb*B, C + nb*B]`` mask of :func:`block_visibility` (0 visible, dtype min hidden)."""
    visible = block_visibility(anchors, block_size, context_len, context_start)
    return torch.zeros(visible.shape, dtype=dtype, device=visible.device).masked_fill_(~visible,
                                                                                       torch.finfo(dtype).min)


def perturb_context(features: torch.Tensor, num_layers: int, std: float,
                    generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """``F + std * rms * N(0, 1)`` (out of place), ``rms`` per row and per layer slice of ``F [C, n*H]``."""
    if std <= 0 or features.numel() == 0:
        return features
    C, nH = features.shape
    f = features.float().view(C, num_layers, nH // num_layers)
    rms = f.pow(2).mean(-1, keepdim=True).sqrt()
    noise = torch.randn(f.shape, generator=generator, dtype=torch.float32).to(f.device)
    return (f + std * rms * noise).view(C, nH).to(features.dtype)


def resolve_logit_layer(spec, target_layer_ids: Sequence[int], num_target_layers: int) -> int:
    """The target-logit layer: ``"last"`` (L-1, exact target choice), ``"last-mapped"`` or an int."""
    if spec in (None, "last"):
        layer = num_target_layers - 1
    elif spec == "last-mapped":
        layer = max(target_layer_ids)
    else:
        try:
            layer = int(spec)
        except (TypeError, ValueError):
            raise ValueError(f"logit layer must be 'last', 'last-mapped' or a layer id, got {spec!r}") from None
    if not 0 <= layer < num_target_layers:
        raise ValueError(f"logit layer {layer} out of range for a target with {num_target_layers} layers")
    if layer in target_layer_ids:
        warnings.warn(
            f"logit layer {layer} is also a context layer {list(target_layer_ids)} (proxy labels): its features "
            "enter the context only at rows before each anchor, and the labels come from rows >= the anchor",
            stacklevel=2,
        )
    return layer


@dataclass
class TargetCapture:
    """One frozen target pass: ``context [T, n*H]`` (context layers only) and ``logit_hidden [T, H]``."""

    context: torch.Tensor
    logit_hidden: torch.Tensor


@torch.no_grad()
def capture_target(adapter: TargetAdapter, ids: torch.Tensor, num_context_layers: int, logit_layer: int,
                   cache=None, segments: Optional[Sequence[int]] = None,
                   chunk_size: Optional[int] = None) -> TargetCapture:
    """Run the frozen target on ``ids [T]`` (positions 0..T-1) and split its captured layers.

    ``adapter`` must capture ``target_layer_ids + [logit_layer]`` in that
    order; the context is the first ``n`` layers' concat, the labels' hidden
    the logit layer's output. ``cache`` (a TargetKVCache of >= T rows) is
    reused when given (cropped to 0 first).

    The pass is the adapter's chunked prefill (causal chunks of
    ``chunk_size`` rows, default :data:`~dflash.target.adapter.MASKED_PREFILL_CHUNK`):
    the target's transient memory is that of one chunk over its prefix, never
    a ``[T, T]`` score or mask, whatever ``T``. ``segments`` (the lengths of
    the samples of a packed sequence, summing to ``T``): one pass per sample,
    each from an empty cache at positions ``0..len-1``, so no sample's
    features see another sample (exactly the features of the sample trained
    alone).
    """
    n = int(num_context_layers)
    if len(adapter.capture_layer_ids) != n + 1 or adapter.capture_layer_ids[-1] != logit_layer:
        raise ValueError(f"the adapter must capture the {n} context layers then the logit layer {logit_layer}, "
                         f"it captures {adapter.capture_layer_ids}")
    T = ids.numel()
    lengths = [T] if segments is None else [int(x) for x in segments]
    if sum(lengths) != T or any(x < 1 for x in lengths):
        raise ValueError(f"segments {lengths} must be positive lengths summing to the sequence's {T} tokens")
    if cache is None:
        cache = adapter.new_cache(max(lengths))
    H = adapter.hidden_size
    features = torch.empty(T, (n + 1) * H, dtype=adapter.dtype, device=adapter.device)
    start = 0
    for length in lengths:
        cache.crop(0)
        _, feats = adapter.prefill(ids[start:start + length], cache,
                                   chunk_size=MASKED_PREFILL_CHUNK if chunk_size is None else chunk_size)
        features[start:start + length] = feats
        start += length
    cache.crop(0)
    return TargetCapture(context=features[:, : n * H], logit_hidden=features[:, n * H:])


@torch.no_grad()
def target_labels(adapter: TargetAdapter, logit_hidden: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """int64 ``[N]``: the target's argmax after each of ``rows`` of the logit layer (final norm fused)."""
    head = adapter.head  # fused ops on the lm_head weight, or the lm_head module (an adapter, a quantized weight)
    if adapter.fuse_norm:
        return head.argmax(logit_hidden, norm_weight=adapter.norm.weight, eps=adapter.norm_eps, positions=rows)
    return head.argmax(adapter.norm(logit_hidden.index_select(0, rows)))


def drafter_block_losses(draft: DFlashDraftModel, lm_head, block_embeds: torch.Tensor,
                         context: torch.Tensor, anchors: torch.Tensor, labels: torch.Tensor,
                         weights: torch.Tensor, fused: bool = True, forward: Optional[Callable] = None,
                         row_starts: Optional[torch.Tensor] = None):
    """Weighted per-position losses ``[nb, B-1]`` and the block states ``[nb*B, H]``.

    ``lm_head``: the target's :class:`~dflash.target.head.TargetHead` (``adapter.head``), or its weight ``[V, H]``.
    ``block_embeds [nb*B, H]`` (block b = rows b*B..b*B+B-1), ``context
    [C, n*H]`` (rows at positions 0..C-1, ``C >= max(anchors)``), ``anchors
    [nb]``, ``labels [nb, B-1]``, ``weights [B]`` (:func:`loss_weights`).
    ``fused=False`` is the naive path (full ``[nb*B, V]`` logits, then
    ``F.cross_entropy``), kept for the memory benchmark and as a check.
    ``row_starts`` (a packed sequence: :func:`~.records.segment_starts`, at
    least ``C`` rows): row ``r`` sits at position ``r - row_starts[r]`` of its
    sample, and a block sees only its anchor's sample's context rows.
    """
    nb, B = anchors.numel(), int(weights.numel())
    C = context.shape[0]
    if block_embeds.shape[0] != nb * B:
        raise ValueError(f"block_embeds has {block_embeds.shape[0]} rows, expected nb*B = {nb}*{B}")
    if nb and C < int(anchors.max()):
        raise ValueError(f"context has {C} rows but an anchor is at {int(anchors.max())}")
    dev = block_embeds.device
    offsets = torch.arange(B, device=dev)
    rows_c = torch.arange(C, device=dev)
    if row_starts is None:
        positions = torch.cat([rows_c, (anchors[:, None] + offsets).flatten()])
        mask = block_attention_mask(anchors, B, C, dtype=draft.fc.weight.dtype)
    else:
        starts = row_starts.to(dev)
        anchor_start = starts[anchors]
        positions = torch.cat([rows_c - starts[:C], ((anchors - anchor_start)[:, None] + offsets).flatten()])
        mask = block_attention_mask(anchors, B, C, dtype=draft.fc.weight.dtype, context_start=anchor_start)
    states = (forward or draft)(block_embeds, context, positions, attn_mask=mask, block_size=B)  # [nb*B, H]
    rows = (torch.arange(nb, device=dev)[:, None] * B + offsets[None, 1:]).flatten()  # k >= 1
    w = weights[1:].to(dev).repeat(nb)
    targets = labels.flatten()
    head = draft.head_hidden(states)  # the drafter's logits: softcap(output_multiplier * W h), as it drafts
    cap = draft.logit_softcap
    lm_head = TargetHead.of(lm_head)
    if fused:
        losses = lm_head.cross_entropy(head, targets, weights=w, positions=rows, softcap=cap)
    else:  # [nb*B, V] logits: what fused avoids
        full = (head.float() @ lm_head.weight.detach().float().T if lm_head.fused else
                lm_head.module_logits(head, frozen=True).float())
        losses = F.cross_entropy(soft_cap(full, cap)[rows], targets, reduction="none") * w
    return losses.view(nb, B - 1), states


@dataclass
class BlockTrainingConfig:
    """What a step does: block size, blocks per sequence, loss decay, logit layer, context noise.

    ``fused=False`` switches labels and loss to the naive recipe (full
    ``[T, V]`` target logits then argmax; full ``[nb*B, V]`` drafter logits
    then ``F.cross_entropy``): same numbers, kept to measure what fusing saves.
    ``selector_loss_weight``: ``alpha``, the weight of a DFlash2 drafter's
    selector loss (:mod:`.selector_objective`) beside the token loss.
    """

    block_size: int
    blocks_per_seq: int = 8
    gamma: Optional[float] = None
    logit_layer: int = -1
    context_noise: float = 0.0
    fused: bool = True
    selector_loss_weight: float = 1.0


def sequence_block_losses(draft: DFlashDraftModel, adapter: TargetAdapter, seq: TrainingSequence,
                          cfg: BlockTrainingConfig, generator: Optional[torch.Generator] = None, cache=None,
                          anchors: Optional[torch.Tensor] = None, store: Optional[dict] = None,
                          forward: Optional[Callable] = None) -> Dict[str, torch.Tensor]:
    """All blocks of one sequence: ``losses [nb, B-1]`` (weighted), ``labels``, ``correct``, ``anchors``.

    For a DFlash2 drafter ``losses`` adds ``cfg.selector_loss_weight`` times
    the weighted selector losses (also returned alone, detached, as
    ``selector_losses``), and ``correct`` is the selector's teacher-forced
    choice (:func:`.selector_objective.selector_block_losses`); otherwise
    ``correct`` compares the drafter's argmax with the labels.

    ``store`` (a dict, optional): keeps each sequence's context features
    ``[T, n*H]`` and its labels at every row (``[T-1]``, the target's argmax
    after row r) keyed by ``seq.line``, so later epochs skip the target
    pass (memory: ``T * n * H`` floats per sequence). Noise is drawn anew
    on every use, on the context only.
    """
    B = int(cfg.block_size)
    dev = adapter.device
    ids = seq.input_ids.to(dev)
    if anchors is None:
        anchors = sample_anchors(sequence_anchor_mask(seq, B), cfg.blocks_per_seq, generator)
    anchors = anchors.to(dev)
    n = len(draft.target_layer_ids)
    label_rows = (anchors[:, None] + torch.arange(B - 1, device=dev)).flatten()  # a + k - 1, k = 1..B-1
    if store is not None and seq.line in store:
        context, all_labels = store[seq.line]
        labels = all_labels[label_rows]
    else:
        cap = capture_target(adapter, ids, n, cfg.logit_layer, cache, segments=seq.segments)
        context = cap.context
        if store is not None:
            all_labels = target_labels(adapter, cap.logit_hidden, torch.arange(ids.numel() - 1, device=dev))
            context = context.contiguous()
            store[seq.line] = (context, all_labels)
            labels = all_labels[label_rows]
        elif cfg.fused:
            labels = target_labels(adapter, cap.logit_hidden, label_rows)
        else:  # the naive recipe: logits of the whole sequence, then argmax (memory benchmark only)
            with torch.no_grad():
                full = adapter.head.logits(adapter.norm(cap.logit_hidden))  # [T, V] fp32
                labels = full.argmax(-1)[label_rows]
                del full
    labels = labels.view(-1, B - 1)
    C = int(anchors.max())
    context = perturb_context(context[:C], n, cfg.context_noise, generator)
    block_ids = torch.full((anchors.numel(), B), draft.mask_token_id, dtype=torch.long, device=dev)
    block_ids[:, 0] = ids[anchors]
    with torch.no_grad():
        embeds = adapter.embed(block_ids.flatten(), raw_scale=draft.input_embedding_scale)
    weights = loss_weights(B, cfg.gamma)
    starts = None if seq.segments is None else segment_starts(seq).to(dev)
    losses, states = drafter_block_losses(draft, adapter.head, embeds, context, anchors, labels, weights,
                                          fused=cfg.fused, forward=forward, row_starts=starts)
    out = dict(labels=labels, anchors=anchors, weight_sum=weights.sum() * anchors.numel())
    if isinstance(draft, DFlash2DraftModel):
        prev = ids[anchors[:, None] + torch.arange(B - 1, device=dev)]  # [nb, B-1]: x[a + k - 1], k = 1..B-1
        selector, correct = selector_block_losses(draft, adapter.head, states, prev, labels, weights)
        out.update(losses=losses + cfg.selector_loss_weight * selector, selector_losses=selector.detach(),
                   correct=correct)
        return out
    with torch.no_grad():
        rows = (torch.arange(anchors.numel(), device=dev)[:, None] * B + torch.arange(1, B, device=dev)).flatten()
        guess = adapter.head.argmax(draft.head_hidden(states.detach()), positions=rows, softcap=draft.logit_softcap)
    out.update(losses=losses, correct=guess.view(-1, B - 1) == labels)
    return out


def sequence_weight_sum(seq: TrainingSequence, cfg: BlockTrainingConfig) -> float:
    """``sum_b sum_{k>=1} w_k`` of one sequence: ``min(blocks_per_seq, #valid anchors) * sum(w)``.

    Known from the loss mask alone (no forward pass), so every rank of a
    distributed step can compute the global batch's normaliser
    ``W = sum over all sequences of the step`` without communicating.
    """
    valid = int(sequence_anchor_mask(seq, cfg.block_size).sum())
    return float(loss_weights(cfg.block_size, cfg.gamma).sum()) * min(int(cfg.blocks_per_seq), valid)


@dataclass
class StepLoss:
    """``loss`` (scalar, differentiable wrt the drafter) and statistics of one (micro-)batch.

    The sums are over this batch's blocks only (detached), so that ranks and
    micro-batches add up: ``loss_sum`` (weighted loss), ``weight_sum``,
    ``tau_sum`` (``sum_b 1 + leading correct drafts``), ``num_blocks``,
    ``supervised_tokens`` (``num_blocks * (B-1)``), and for a DFlash2 drafter
    ``selector_loss_sum`` (the weighted selector losses alone, before ``alpha``).
    """

    loss: torch.Tensor
    num_blocks: int
    position_accuracy: torch.Tensor  # [B-1] fraction of blocks whose draft at position k equals the label
    block_tau: float  # mean of 1 + (leading correct drafts): the acceptance these blocks would get
    loss_sum: float = 0.0
    weight_sum: float = 0.0
    tau_sum: float = 0.0
    supervised_tokens: int = 0
    selector_loss_sum: float = 0.0


def step_loss(draft: DFlashDraftModel, adapter: TargetAdapter, batch: Sequence[TrainingSequence],
              cfg: BlockTrainingConfig, generator: Optional[torch.Generator] = None, cache=None,
              store: Optional[dict] = None, *, generators: Optional[Sequence[torch.Generator]] = None,
              normalizer: Optional[float] = None, forward: Optional[Callable] = None) -> StepLoss:
    """The weighted block loss over a batch of sequences (one drafter pass per sequence).

    ``loss = sum_{seq, b, k>=1} w_k CE_{b,k} / N`` with ``N = normalizer``
    (the whole global batch's :func:`sequence_weight_sum`, for a rank's
    share or one micro-batch of it) or, by default, this batch's own weight
    sum. ``generators`` (one per sequence) draw each sequence's anchors and
    noise, so a sequence gets the same blocks on whichever rank it lands;
    without them the single ``generator`` is used in order.
    """
    if generators is not None and len(generators) != len(batch):
        raise ValueError(f"got {len(generators)} generators for {len(batch)} sequences")
    total, weight_sum, correct, selector_sum = 0.0, 0.0, [], 0.0
    for i, seq in enumerate(batch):
        gen = generators[i] if generators is not None else generator
        out = sequence_block_losses(draft, adapter, seq, cfg, gen, cache, store=store, forward=forward)
        total = total + out["losses"].sum()
        if "selector_losses" in out:
            selector_sum += float(out["selector_losses"].sum())
        weight_sum += float(out["weight_sum"])
        correct.append(out["correct"])
    correct = torch.cat(correct).float()
    leading = torch.cumprod(correct, dim=1).sum(1)
    loss = total / (weight_sum if normalizer is None else float(normalizer))
    return StepLoss(loss=loss, num_blocks=correct.shape[0], position_accuracy=correct.mean(0),
                    block_tau=float((1 + leading).mean()), loss_sum=float(total.detach()), weight_sum=weight_sum,
                    tau_sum=float((1 + leading).sum()), supervised_tokens=int(correct.numel()),
                    selector_loss_sum=selector_sum)
