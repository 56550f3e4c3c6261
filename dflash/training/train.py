"""Training a DFlash drafter against a frozen target, and its CLI.

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
4. Labels: the target's greedy choice at block position ``k >= 1`` (absolute
   position ``a+k``) is its argmax after position ``a+k-1``::

       y[b, k] = argmax(lm_head(final_norm(G[a_b + k - 1])))   k = 1..B-1

   computed with the fused :func:`dflash_kernels.lm_head_argmax` at those
   ``nb*(B-1)`` rows only (final norm fused).
5. Loss: the drafter's final-normed block states ``S [nb*B, H]`` through the
   frozen target lm_head ``W [V, H]``, fused cross-entropy
   (:func:`dflash_kernels.lm_head_cross_entropy`) at rows ``k >= 1``::

       loss = sum_{b,k>=1} w_k * CE(W S[b*B+k], y[b, k]) / sum_{b,k>=1} w_k
       w_k  = exp(-(k - 1) / gamma)        (k = 0, the anchor, carries no loss)

   No ``[positions, vocab]`` tensor is built beyond one chunk of the fused
   ops (on CPU without Triton the ops' reference path materializes
   ``[nb*(B-1), V]`` logits of the supervised rows only, never of the whole
   sequence).

``gamma`` defaults to :func:`default_gamma` (7 for B=16, 5 for B=10, 4 for B=8).

CLI: ``python -m dflash train --target DIR --data FILE --out DIR ...``
(see :func:`build_parser`); the out directory receives the drafter in the
published format (``config.json`` + ``model.safetensors``), ``train_log.json``
and, unless ``--state-dir`` puts it elsewhere, ``training_state.pt``
(fp32 weights, optimizer, step, elapsed time) for ``--resume``.

The shipped tiny drafter (``dflash/assets/tiny/drafter``) comes from::

    python -m dflash.training.data --target dflash/assets/tiny/target --out /tmp/tiny_drafter_data.jsonl \
        --num 4096 --prompt-len 128 --new-tokens 256 --batch-size 64 --seed 0
    python -m dflash train --target dflash/assets/tiny/target --data /tmp/tiny_drafter_data.jsonl \
        --out dflash/assets/tiny/drafter --state-dir /tmp/tiny_drafter_state --layers 2 --block-size 8 \
        --target-layer-ids 1,3 --steps 2800 --batch-size 8 --blocks-per-seq 32 --lr 1e-3 --cache-target \
        --eval-every 500 --final-eval --seed 0 --threads 1

(one CPU thread; ``train_log.json`` next to the weights holds the measured
numbers). With ``--steps`` alone the learning-rate schedule depends on the
step count only, so the run is reproducible step for step for a seed;
``--minutes`` makes it depend on the machine's speed.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import torch
import torch.nn.functional as F

import dflash_kernels

from ..drafter.config import DraftConfigError, default_target_layer_ids, make_draft_config
from .data import DataError, TrainingSequence, read_prompts_jsonl, read_training_jsonl, valid_anchor_mask
from ..drafter.model import DFlashDraftModel
from ..target import TargetAdapter

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
    "StepLoss",
    "step_loss",
    "measure_tau",
    "build_parser",
    "train",
    "main",
]

STATE_NAME = "training_state.pt"
LOG_NAME = "train_log.json"
_SAVE_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


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


def block_visibility(anchors: torch.Tensor, block_size: int, context_len: int) -> torch.Tensor:
    """bool ``[nb*B, C + nb*B]``: which keys each block query sees.

    Query ``b*B + j`` sees context row ``p`` iff ``p < anchors[b]`` and block
    key ``C + b'*B + j'`` iff ``b' == b``.
    """
    nb, B, C = anchors.numel(), int(block_size), int(context_len)
    q_block = torch.arange(nb, device=anchors.device).repeat_interleave(B)  # [nb*B]
    ctx = torch.arange(C, device=anchors.device)[None, :] < anchors[q_block][:, None]  # [nb*B, C]
    blk = q_block[:, None] == q_block[None, :]  # [nb*B, nb*B]
    return torch.cat([ctx, blk], dim=1)


def block_attention_mask(anchors: torch.Tensor, block_size: int, context_len: int,
                         dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Additive ``[nb*B, C + nb*B]`` mask of :func:`block_visibility` (0 visible, dtype min hidden)."""
    visible = block_visibility(anchors, block_size, context_len)
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
                   cache=None) -> TargetCapture:
    """Run the frozen target on ``ids [T]`` (positions 0..T-1) and split its captured layers.

    ``adapter`` must capture ``target_layer_ids + [logit_layer]`` in that
    order; the context is the first ``n`` layers' concat, the labels' hidden
    the logit layer's output. ``cache`` (a TargetKVCache of >= T rows) is
    reused when given (cropped to 0 first).
    """
    n = int(num_context_layers)
    if len(adapter.capture_layer_ids) != n + 1 or adapter.capture_layer_ids[-1] != logit_layer:
        raise ValueError(f"the adapter must capture the {n} context layers then the logit layer {logit_layer}, "
                         f"it captures {adapter.capture_layer_ids}")
    T = ids.numel()
    if cache is None:
        cache = adapter.new_cache(T)
    cache.crop(0)
    adapter.forward(ids, torch.arange(T, device=ids.device), cache)
    H = adapter.hidden_size
    context = adapter.context_features()[:, : n * H]
    return TargetCapture(context=context, logit_hidden=adapter.captured_layer(logit_layer))


@torch.no_grad()
def target_labels(adapter: TargetAdapter, logit_hidden: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """int64 ``[N]``: the target's argmax after each of ``rows`` of the logit layer (final norm fused)."""
    W = adapter.lm_head.weight
    if adapter.fuse_norm:
        return dflash_kernels.lm_head_argmax(logit_hidden, W, norm_weight=adapter.norm.weight, eps=adapter.norm_eps,
                                             positions=rows)
    return dflash_kernels.lm_head_argmax(adapter.norm(logit_hidden.index_select(0, rows)), W)


def drafter_block_losses(draft: DFlashDraftModel, lm_head_weight: torch.Tensor, block_embeds: torch.Tensor,
                         context: torch.Tensor, anchors: torch.Tensor, labels: torch.Tensor,
                         weights: torch.Tensor, fused: bool = True):
    """Weighted per-position losses ``[nb, B-1]`` and the block states ``[nb*B, H]``.

    ``block_embeds [nb*B, H]`` (block b = rows b*B..b*B+B-1), ``context
    [C, n*H]`` (rows at positions 0..C-1, ``C >= max(anchors)``), ``anchors
    [nb]``, ``labels [nb, B-1]``, ``weights [B]`` (:func:`loss_weights`).
    ``fused=False`` is the naive path (full ``[nb*B, V]`` logits, then
    ``F.cross_entropy``), kept for the memory benchmark and as a check.
    """
    nb, B = anchors.numel(), int(weights.numel())
    C = context.shape[0]
    if block_embeds.shape[0] != nb * B:
        raise ValueError(f"block_embeds has {block_embeds.shape[0]} rows, expected nb*B = {nb}*{B}")
    if nb and C < int(anchors.max()):
        raise ValueError(f"context has {C} rows but an anchor is at {int(anchors.max())}")
    dev = block_embeds.device
    offsets = torch.arange(B, device=dev)
    positions = torch.cat([torch.arange(C, device=dev), (anchors[:, None] + offsets).flatten()])
    mask = block_attention_mask(anchors, B, C, dtype=draft.fc.weight.dtype)
    states = draft(block_embeds, context, positions, attn_mask=mask)  # [nb*B, H]
    rows = (torch.arange(nb, device=dev)[:, None] * B + offsets[None, 1:]).flatten()  # k >= 1
    w = weights[1:].to(dev).repeat(nb)
    targets = labels.flatten()
    if fused:
        losses = dflash_kernels.lm_head_cross_entropy(states, lm_head_weight.detach(), targets, weights=w,
                                                      positions=rows)
    else:
        logits = states.float() @ lm_head_weight.detach().float().T  # [nb*B, V]: what fused avoids
        losses = F.cross_entropy(logits[rows], targets, reduction="none") * w
    return losses.view(nb, B - 1), states


@dataclass
class BlockTrainingConfig:
    """What a step does: block size, blocks per sequence, loss decay, logit layer, context noise.

    ``fused=False`` switches labels and loss to the naive recipe (full
    ``[T, V]`` target logits then argmax; full ``[nb*B, V]`` drafter logits
    then ``F.cross_entropy``): same numbers, kept to measure what fusing saves.
    """

    block_size: int
    blocks_per_seq: int = 8
    gamma: Optional[float] = None
    logit_layer: int = -1
    context_noise: float = 0.0
    fused: bool = True


def sequence_block_losses(draft: DFlashDraftModel, adapter: TargetAdapter, seq: TrainingSequence,
                          cfg: BlockTrainingConfig, generator: Optional[torch.Generator] = None, cache=None,
                          anchors: Optional[torch.Tensor] = None, store: Optional[dict] = None
                          ) -> Dict[str, torch.Tensor]:
    """All blocks of one sequence: ``losses [nb, B-1]`` (weighted), ``labels``, ``correct``, ``anchors``.

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
        anchors = sample_anchors(valid_anchor_mask(seq.loss_mask, B), cfg.blocks_per_seq, generator)
    anchors = anchors.to(dev)
    n = len(draft.target_layer_ids)
    label_rows = (anchors[:, None] + torch.arange(B - 1, device=dev)).flatten()  # a + k - 1, k = 1..B-1
    if store is not None and seq.line in store:
        context, all_labels = store[seq.line]
        labels = all_labels[label_rows]
    else:
        cap = capture_target(adapter, ids, n, cfg.logit_layer, cache)
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
                full = adapter.norm(cap.logit_hidden).float() @ adapter.lm_head.weight.float().T  # [T, V]
                labels = full.argmax(-1)[label_rows]
                del full
    labels = labels.view(-1, B - 1)
    C = int(anchors.max())
    context = perturb_context(context[:C], n, cfg.context_noise, generator)
    block_ids = torch.full((anchors.numel(), B), draft.mask_token_id, dtype=torch.long, device=dev)
    block_ids[:, 0] = ids[anchors]
    with torch.no_grad():
        embeds = adapter.embed(block_ids.flatten())
    weights = loss_weights(B, cfg.gamma)
    losses, states = drafter_block_losses(draft, adapter.lm_head.weight, embeds, context, anchors, labels, weights,
                                          fused=cfg.fused)
    with torch.no_grad():
        rows = (torch.arange(anchors.numel(), device=dev)[:, None] * B + torch.arange(1, B, device=dev)).flatten()
        guess = dflash_kernels.lm_head_argmax(states.detach(), adapter.lm_head.weight, positions=rows)
    return dict(losses=losses, labels=labels, correct=guess.view(-1, B - 1) == labels, anchors=anchors,
                weight_sum=weights.sum() * anchors.numel())


@dataclass
class StepLoss:
    """``loss`` (scalar, differentiable wrt the drafter) and statistics of one step."""

    loss: torch.Tensor
    num_blocks: int
    position_accuracy: torch.Tensor  # [B-1] fraction of blocks whose draft at position k equals the label
    block_tau: float  # mean of 1 + (leading correct drafts): the acceptance these blocks would get


def step_loss(draft: DFlashDraftModel, adapter: TargetAdapter, batch: Sequence[TrainingSequence],
              cfg: BlockTrainingConfig, generator: Optional[torch.Generator] = None, cache=None,
              store: Optional[dict] = None) -> StepLoss:
    """The weighted block loss over a batch of sequences (one drafter pass per sequence)."""
    total, weight_sum, correct = 0.0, 0.0, []
    for seq in batch:
        out = sequence_block_losses(draft, adapter, seq, cfg, generator, cache, store=store)
        total = total + out["losses"].sum()
        weight_sum += float(out["weight_sum"])
        correct.append(out["correct"])
    correct = torch.cat(correct).float()
    leading = torch.cumprod(correct, dim=1).sum(1)
    return StepLoss(loss=total / weight_sum, num_blocks=correct.shape[0], position_accuracy=correct.mean(0),
                    block_tau=float((1 + leading).mean()))


# --------------------------------------------------------------------------- evaluation


def measure_tau(target, draft, prompts: Sequence[Sequence[int]], *, method: str = "dflash",
                temperature: float = 0.0, max_new_tokens: int = 128, tree_budget: Optional[int] = None,
                seed: int = 0) -> Dict[str, float]:
    """Pooled tau (committed tokens / rounds over all prompts) and tokens/s of ``dflash.generate``.

    No stop token (every prompt yields ``max_new_tokens``); at ``T > 0``
    prompt ``i`` uses seed ``seed + i``.
    """
    from ..decoding import generate

    was_training = draft.training
    draft.eval()
    committed = rounds = 0
    seconds = 0.0
    try:
        for i, p in enumerate(prompts):
            r = generate(target, draft, torch.tensor(p, dtype=torch.long), method=method,
                         max_new_tokens=max_new_tokens, temperature=temperature, seed=seed + i,
                         tree_budget=tree_budget)
            committed += sum(r.acceptance_lengths)
            rounds += r.num_rounds
            seconds += r.total_time
    finally:
        draft.train(was_training)
    return dict(tau=committed / max(rounds, 1), tokens_per_second=committed / seconds if seconds else float("nan"))


# --------------------------------------------------------------------------- CLI


def _int_list(text: str) -> List[int]:
    try:
        return [int(x) for x in text.replace(" ", "").split(",") if x]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m dflash train",
                                description="Train a DFlash drafter for a frozen target.")
    io = p.add_argument_group("data and files")
    io.add_argument("--target", required=True, help="local target directory (HF causal LM)")
    io.add_argument("--data", required=True, help="training JSONL: {'input_ids': [...], 'loss_mask': [...]} "
                                                  "or {'text': ...} per line")
    io.add_argument("--out", required=True, help="output drafter directory (published format)")
    io.add_argument("--tokenizer", default=None,
                    help="'byte', or a local tokenizer directory (default: the target directory)")
    io.add_argument("--init", default=None, help="start from this drafter directory instead of a fresh one")
    io.add_argument("--resume", action="store_true", help="continue from the training state in --state-dir")
    io.add_argument("--state-dir", default=None, help=f"where {STATE_NAME} goes (default: --out)")
    io.add_argument("--save-dtype", choices=sorted(_SAVE_DTYPES), default="bf16", help="stored weight dtype")
    io.add_argument("--save-every", type=int, default=200, help="checkpoint every N steps (and at the end)")
    io.add_argument("--max-length", type=int, default=None, help="crop training sequences to this length")
    io.add_argument("--cache-target", action="store_true",
                    help="keep each sequence's target features and labels in memory after its first pass "
                         "(T*n*H floats per sequence; later epochs skip the target)")
    arch = p.add_argument_group("drafter architecture (ignored with --init / --resume)")
    arch.add_argument("--layers", type=int, default=2)
    arch.add_argument("--block-size", type=int, default=8)
    arch.add_argument("--target-layer-ids", type=_int_list, default=None,
                      help="comma-separated target layers read by the drafter (default: the published spread)")
    arch.add_argument("--heads", type=int, default=None, help="default: the target's")
    arch.add_argument("--kv-heads", type=int, default=None, help="default: the target's")
    arch.add_argument("--head-dim", type=int, default=None, help="default: the target's")
    arch.add_argument("--intermediate-size", type=int, default=None, help="default: the target's")
    arch.add_argument("--mask-token-id", type=int, default=None, help="default: the tokenizer's mask id")
    opt = p.add_argument_group("optimization")
    opt.add_argument("--steps", type=int, default=None, help="number of optimizer steps")
    opt.add_argument("--minutes", type=float, default=None, help="wall-clock budget (default 20 without --steps)")
    opt.add_argument("--batch-size", type=int, default=8, help="sequences per step")
    opt.add_argument("--blocks-per-seq", type=int, default=16)
    opt.add_argument("--lr", type=float, default=1e-3)
    opt.add_argument("--warmup-steps", type=int, default=50)
    opt.add_argument("--weight-decay", type=float, default=0.01)
    opt.add_argument("--grad-clip", type=float, default=1.0)
    opt.add_argument("--gamma", type=float, default=None, help="loss decay (default from B: 4 for 8, 7 for 16)")
    opt.add_argument("--logit-layer", default="last", help="'last' (exact target choice), 'last-mapped' or an id")
    opt.add_argument("--context-noise", type=float, default=0.0, help="noise std on context features, x RMS")
    opt.add_argument("--seed", type=int, default=0)
    opt.add_argument("--threads", type=int, default=1,
                     help="torch threads (default 1: on a shared or small CPU more threads often run slower)")
    ev = p.add_argument_group("evaluation")
    ev.add_argument("--eval-every", type=int, default=0, help="measure tau every N steps (0: off)")
    ev.add_argument("--eval-prompts", default=None, help="prompt JSONL (default for byte targets: held-out stdlib)")
    ev.add_argument("--eval-num-prompts", type=int, default=8)
    ev.add_argument("--eval-prompt-len", type=int, default=128)
    ev.add_argument("--eval-new-tokens", type=int, default=96)
    ev.add_argument("--final-eval", action="store_true",
                    help="after training: tau table (T=0 and 0.7; DFlash and DDTree budgets; untrained alongside)")
    ev.add_argument("--final-eval-prompts", type=int, default=16)
    ev.add_argument("--final-eval-new-tokens", type=int, default=128)
    ev.add_argument("--ddtree-budgets", type=_int_list, default=[8, 32])
    ev.add_argument("--quiet", action="store_true", help="no progress bar")
    return p


def _load_tokenizer(args):
    from ..tiny.pair import load_tokenizer
    from ..tiny.tokenizer import ByteTokenizer

    if args.tokenizer == "byte":
        return ByteTokenizer()
    directory = args.tokenizer or args.target
    try:
        return load_tokenizer(directory)
    except Exception as e:  # no tokenizer there: token-id data still works
        if args.tokenizer is not None:
            raise SystemExit(f"cannot load the tokenizer from {directory}: {e}")
        return None


def _new_drafter(args, target, tokenizer) -> DFlashDraftModel:
    cfg = target.config
    L = cfg.num_hidden_layers
    mask_id = args.mask_token_id
    if mask_id is None:
        mask_id = getattr(tokenizer, "mask_token_id", None)
    if mask_id is None:
        raise SystemExit("the tokenizer has no mask token: give --mask-token-id (an id the drafter uses as MASK)")
    ids = args.target_layer_ids or default_target_layer_ids(L, args.layers)
    config = make_draft_config(
        hidden_size=cfg.hidden_size, num_hidden_layers=args.layers,
        num_attention_heads=args.heads or cfg.num_attention_heads,
        num_key_value_heads=args.kv_heads or getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads,
        head_dim=args.head_dim or getattr(cfg, "head_dim", None),
        intermediate_size=args.intermediate_size or cfg.intermediate_size, vocab_size=cfg.vocab_size,
        num_target_layers=L, block_size=args.block_size, mask_token_id=mask_id, target_layer_ids=ids,
        rms_norm_eps=getattr(cfg, "rms_norm_eps", 1e-6),
        max_position_embeddings=getattr(cfg, "max_position_embeddings", 4096),
    )
    torch.manual_seed(args.seed)
    return DFlashDraftModel(config)


def _param_groups(model: torch.nn.Module, weight_decay: float) -> List[dict]:
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    other = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    return [dict(params=decay, weight_decay=weight_decay), dict(params=other, weight_decay=0.0)]


def _lr_at(progress: float, step: int, peak: float, warmup: int, final_fraction: float = 0.1) -> float:
    """Linear warmup over ``warmup`` steps, then cosine from ``peak`` to ``final_fraction * peak``."""
    if step < warmup:
        return peak * (step + 1) / warmup
    p = min(max(progress, 0.0), 1.0)
    return peak * (final_fraction + (1 - final_fraction) * 0.5 * (1 + math.cos(math.pi * p)))


def _batch_indices(step: int, batch_size: int, n: int, seed: int) -> List[int]:
    """Sequences of step ``step``: epochs of a seeded permutation, so a resumed run continues exactly."""
    out = []
    for g in range(step * batch_size, (step + 1) * batch_size):
        epoch, i = divmod(g, n)
        perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed * 1_000_003 + epoch))
        out.append(int(perm[i]))
    return out


def _eval_prompts(args, tokenizer, vocab_size: int, n: int, seed: int) -> Optional[List[List[int]]]:
    if args.eval_prompts:
        return read_prompts_jsonl(args.eval_prompts, vocab_size, tokenizer)[:n]
    if getattr(tokenizer, "num_byte_ids", None) == 256:
        from .stdlib_corpus import heldout_prompts

        return heldout_prompts(n, args.eval_prompt_len, seed=seed)
    return None


def _save(args, draft, optimizer, step, elapsed, history, state_dir: Path) -> None:
    draft.save_pretrained(args.out, dtype=_SAVE_DTYPES[args.save_dtype])
    state_dir.mkdir(parents=True, exist_ok=True)
    tmp = state_dir / (STATE_NAME + ".tmp")
    torch.save(dict(step=step, elapsed=elapsed, model=draft.state_dict(), optimizer=optimizer.state_dict(),
                    history=history, config=draft.config.to_dict()), tmp)
    os.replace(tmp, state_dir / STATE_NAME)


def _final_eval(args, target, draft_dir: str, untrained: DFlashDraftModel, prompts) -> Dict[str, dict]:
    """tau at T=0 and T=0.7 for DFlash (B) and DDTree budgets, trained (as saved, fp32) vs untrained."""
    trained = DFlashDraftModel.from_pretrained(draft_dir, dtype=torch.float32)
    table: Dict[str, dict] = {}
    methods = [("dflash", None)] + [("ddtree", b) for b in args.ddtree_budgets]
    for temperature in (0.0, 0.7):
        for method, budget in methods:
            key = f"{method}" + (f"_budget{budget}" if budget else f"_B{trained.block_size}") + f"_T{temperature}"
            row = {}
            for name, draft in (("trained", trained), ("untrained", untrained)):
                m = measure_tau(target, draft, prompts, method=method, temperature=temperature,
                                max_new_tokens=args.final_eval_new_tokens, tree_budget=budget, seed=args.seed)
                row[name] = {k: round(v, 3) for k, v in m.items()}
            table[key] = row
            print(f"{key:28s} tau trained {row['trained']['tau']:.2f}  untrained {row['untrained']['tau']:.2f}",
                  file=sys.stderr, flush=True)
    return table


def train(args: argparse.Namespace) -> dict:
    """Train (or resume), checkpoint, optionally measure; returns the train log written to ``--out``."""
    from tqdm import tqdm

    from ..tiny.pair import load_target

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    out_dir = Path(args.out)
    state_dir = Path(args.state_dir) if args.state_dir else out_dir
    minutes = args.minutes if (args.minutes is not None or args.steps is not None) else 20.0

    target = load_target(args.target)
    target.requires_grad_(False)
    tokenizer = _load_tokenizer(args)
    vocab = target.config.vocab_size

    state = None
    if args.resume:
        path = state_dir / STATE_NAME
        if not path.is_file():
            raise SystemExit(f"--resume: no {STATE_NAME} in {state_dir}")
        state = torch.load(path, map_location="cpu", weights_only=False)
        from ..drafter.config import qwen3_config

        raw = dict(state["config"])
        raw.pop("architectures", None)
        draft = DFlashDraftModel(qwen3_config(raw))
        draft.load_state_dict(state["model"], strict=False)
    elif args.init:
        draft = DFlashDraftModel.from_pretrained(args.init, dtype=torch.float32)
    else:
        draft = _new_drafter(args, target, tokenizer)
    draft = draft.float().train()
    B = draft.block_size

    sequences = read_training_jsonl(args.data, vocab, B, tokenizer=tokenizer, max_length=args.max_length)
    adapter = TargetAdapter(target, list(draft.target_layer_ids) + [
        resolve_logit_layer(args.logit_layer, draft.target_layer_ids, target.config.num_hidden_layers)])
    from ..decoding import check_pair as _check_pair

    _check_pair(adapter, draft)
    cfg = BlockTrainingConfig(block_size=B, blocks_per_seq=args.blocks_per_seq, gamma=args.gamma,
                              logit_layer=adapter.capture_layer_ids[-1], context_noise=args.context_noise)
    cache = adapter.new_cache(max(s.input_ids.numel() for s in sequences))
    store = {} if args.cache_target else None

    optimizer = torch.optim.AdamW(_param_groups(draft, args.weight_decay), lr=args.lr, betas=(0.9, 0.95))
    step, elapsed_before, history = 0, 0.0, []
    if state is not None:
        optimizer.load_state_dict(state["optimizer"])
        step, elapsed_before, history = int(state["step"]), float(state["elapsed"]), list(state["history"])

    eval_prompts = None
    if args.eval_every:
        eval_prompts = _eval_prompts(args, tokenizer, vocab, args.eval_num_prompts, seed=1)
        if eval_prompts is None:
            warnings.warn("no evaluation prompts (give --eval-prompts): periodic tau evaluation is off")

    start = time.perf_counter()

    def elapsed() -> float:
        return elapsed_before + time.perf_counter() - start

    def progress() -> float:
        fr = []
        if args.steps is not None:
            fr.append(step / args.steps)
        if minutes is not None:
            fr.append(elapsed() / (minutes * 60))
        return max(fr)

    bar = tqdm(total=args.steps, initial=step, desc="drafter", unit="step", disable=args.quiet,
               mininterval=1.0 if sys.stderr.isatty() else 30.0, dynamic_ncols=True)
    recent: List[float] = []
    recent_tau: List[float] = []
    last_eval = float("nan")
    while progress() < 1.0:
        lr = _lr_at(progress(), step, args.lr, args.warmup_steps)
        for group in optimizer.param_groups:
            group["lr"] = lr
        gen = torch.Generator().manual_seed(args.seed * 7_919 + step)
        batch = [sequences[i] for i in _batch_indices(step, args.batch_size, len(sequences), args.seed)]
        out = step_loss(draft, adapter, batch, cfg, generator=gen, cache=cache, store=store)
        if not torch.isfinite(out.loss):
            raise FloatingPointError(f"training loss became {out.loss.item()} at step {step}; lower --lr")
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(draft.parameters(), args.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step += 1
        recent = (recent + [out.loss.item()])[-50:]
        recent_tau = (recent_tau + [out.block_tau])[-50:]
        entry = None
        if eval_prompts and step % args.eval_every == 0:
            last_eval = measure_tau(target, draft, eval_prompts, max_new_tokens=args.eval_new_tokens)["tau"]
            entry = dict(step=step, minutes=round(elapsed() / 60, 2), lr=lr,
                         loss=round(sum(recent) / len(recent), 4),
                         block_tau=round(sum(recent_tau) / len(recent_tau), 3), eval_tau_T0=round(last_eval, 3))
        elif step % 50 == 0:
            entry = dict(step=step, minutes=round(elapsed() / 60, 2), lr=lr, loss=round(sum(recent) / len(recent), 4),
                         block_tau=round(sum(recent_tau) / len(recent_tau), 3))
        if entry is not None:
            history.append(entry)
            if not sys.stderr.isatty() and not args.quiet:
                print(json.dumps(entry), file=sys.stderr, flush=True)
        if args.save_every and step % args.save_every == 0:
            _save(args, draft, optimizer, step, elapsed(), history, state_dir)
        bar.update(1)
        bar.set_postfix(loss=f"{out.loss.item():.3f}", block_tau=f"{out.block_tau:.2f}", eval_tau=f"{last_eval:.2f}",
                        refresh=False)
    bar.close()
    train_seconds = elapsed()
    _save(args, draft, optimizer, step, train_seconds, history, state_dir)

    log = {
        "command": "python -m dflash train " + " ".join(getattr(args, "argv", [])),
        "seed": args.seed,
        "steps": step,
        "train_minutes": round(train_seconds / 60, 2),
        "train_loss_last50": round(sum(recent) / max(len(recent), 1), 4),
        "block_tau_last50": round(sum(recent_tau) / max(len(recent_tau), 1), 3),
        "data": {"file": str(args.data), "sequences": len(sequences),
                 "tokens": int(sum(s.input_ids.numel() for s in sequences)),
                 "supervised_tokens": int(sum(int(s.loss_mask.sum()) for s in sequences))},
        "drafter": {"layers": draft.config.num_hidden_layers, "block_size": B,
                    "target_layer_ids": list(draft.target_layer_ids), "logit_layer": cfg.logit_layer,
                    "parameters": sum(p.numel() for p in draft.parameters()),
                    "weights_bytes": (out_dir / "model.safetensors").stat().st_size,
                    "storage_dtype": args.save_dtype},
        "hyperparameters": {"batch_size": args.batch_size, "blocks_per_seq": args.blocks_per_seq, "lr": args.lr,
                            "warmup_steps": args.warmup_steps, "weight_decay": args.weight_decay,
                            "grad_clip": args.grad_clip, "gamma": default_gamma(B) if args.gamma is None else args.gamma,
                            "context_noise": args.context_noise, "minutes": minutes, "max_steps": args.steps},
        "threads": args.threads,
        "versions": {"python": platform.python_version(), "torch": torch.__version__,
                     "transformers": __import__("transformers").__version__},
        "history": history,
    }
    if args.final_eval:
        prompts = _eval_prompts(args, tokenizer, vocab, args.final_eval_prompts, seed=0)
        if prompts is None:
            warnings.warn("no evaluation prompts (give --eval-prompts): final evaluation skipped")
        else:
            torch.manual_seed(args.seed)
            untrained = DFlashDraftModel(draft.config).float().eval()
            t0 = time.perf_counter()
            with dflash_kernels.force_backend("reference"):
                log["final_eval"] = {
                    "prompts": len(prompts), "prompt_tokens": len(prompts[0]) if prompts else 0,
                    "new_tokens": args.final_eval_new_tokens,
                    "set": "held-out stdlib packages (json, email, asyncio, xml), heldout_prompts(seed=0)"
                    if not args.eval_prompts else args.eval_prompts,
                    "weights": "saved file reloaded in fp32; untrained = fresh init, same config and seed",
                    "tau": _final_eval(args, target, str(out_dir), untrained, prompts),
                }
            log["final_eval"]["seconds"] = round(time.perf_counter() - t0, 1)
    (out_dir / LOG_NAME).write_text(json.dumps(log, indent=2) + "\n")
    adapter.close()
    return log


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``python -m dflash train ...``; bad data exits with the file and line in the message."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    args.argv = argv
    if args.steps is not None and args.steps < 1:
        raise SystemExit("--steps must be >= 1")
    try:
        train(args)
    except (DataError, DraftConfigError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
