"""The processed distribution over the vocabulary, served in chunks, and the Gumbel noise its draws use.

Shared by :mod:`dflash_kernels.sampling` (one draw per row) and :mod:`dflash_kernels.rejection` (the lossless
acceptance of a chain): transformers' processing of the logits (temperature ``T``, then top-k, top-p, min-p;
the math: :mod:`dflash_kernels.reference.sampling`) without ever holding ``[N, V]`` logits.

Why a histogram, not a top-K buffer: top-p's kept set is a prefix of the vocabulary in (score desc, id
desc) order whose length is unbounded (a flat distribution keeps about ``p * V`` tokens), and bf16 ties at the
k-th value make even top-k's set larger than k. But a 16-bit logit has at most 2**16 distinct values, and the
processed score ``x / T`` depends on that value only. So for ``logit_dtype`` bf16 / fp16:

1. pass 1 (vocab chunks, :func:`histogram_support`): per row, the count of tokens at each of the 65536
   values (``counts [R, 65536]`` int32; the 16-bit pattern mapped to an order-preserving key, -0 merged
   with +0, :func:`value_keys`);
2. selection (:func:`select_support`), exact in integers and the bins' masses ``count * exp(s_b - max)``
   (cumulative masses in fp64): top-k = the bins down to the one where the cumulative count reaches k (ties
   all kept); top-p = per bin the number of tokens whose preceding mass is ``< p`` (ties at the cut: the
   highest ids, see the reference); min-p = bins with ``P_b >= min_p * P_max``. The result per row is a
   boundary value ``key*`` and a count ``r``: the support is every token above ``key*`` plus the ``r``
   highest ids at ``key*`` (:class:`HistogramSupport`; the rank of a tied token is a running per-row count
   over the chunks).

Later passes recompute each chunk's logits and read its support mask, probabilities ``exp(s - top) / mass``
and scores (:class:`ProcessedChunks`). fp32 logits (2**32 values) take full-vocabulary row chunks and the reference
warpers (the dense path). :func:`sample_processed_plan` sizes the chunks: one ``[R, Vc]`` logits chunk with
``R * Vc <= chunk_elements`` (default :data:`DEFAULT_CHUNK_ELEMENTS`), ``R <= HISTOGRAM_ROWS``.

Noise (:func:`noise_source`): Gumbel ``G = -log(-log U)`` from a ``torch.Generator``, or keyed by a device
seed tensor, :func:`dflash_kernels.noise.gumbel_noise_block` (a pure function of the seed's value, the row
and the vocab id, generated on the device).

No host synchronization: every shape follows from N, V and the budget.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Tuple

import torch

from .lm_head import lm_head_logits
from .noise import gumbel_noise_block
from .reference.lm_head import HeadInputs
from .reference.sampling import processed_scores

__all__ = []  # building blocks of sampling and rejection (imported by name), no op of their own

#: fp32 values per logits chunk (and per noise chunk): 2**25 = 128 MiB.
DEFAULT_CHUNK_ELEMENTS = 1 << 25
#: Rows whose 65536-bin histograms are built at once.
HISTOGRAM_ROWS = 64
NUM_BINS = 1 << 16
HALF_DTYPES = (torch.bfloat16, torch.float16)


def sample_processed_plan(n_rows: int, vocab: int, logit_dtype: torch.dtype,
                          chunk_elements: Optional[int] = None) -> dict:
    """How the op chunks ``n_rows`` rows: ``method`` ('histogram' or 'dense'), ``rows`` per chunk, ``vocab``
    ids per chunk, and ``logits_elements`` (the largest logits chunk, ``rows * vocab <= chunk_elements``)."""
    budget = max(1, int(chunk_elements or DEFAULT_CHUNK_ELEMENTS))
    n_rows = max(1, int(n_rows))
    if logit_dtype in HALF_DTYPES:
        rows = min(n_rows, HISTOGRAM_ROWS)
        vc = vocab if rows * vocab <= budget else min(vocab, max(256, budget // rows // 256 * 256))
        return dict(method="histogram", rows=rows, vocab=vc, logits_elements=rows * vc)
    rows = max(1, min(n_rows, budget // vocab))
    return dict(method="dense", rows=rows, vocab=vocab, logits_elements=rows * vocab)




def value_keys(logits: torch.Tensor) -> torch.Tensor:
    """int64 order-preserving key in [0, 65536) of bf16 / fp16 ``logits`` (-0 and +0 share 0x8000)."""
    bits = logits.view(torch.int16).to(torch.int32) & 0xFFFF
    bits = torch.where(bits == 0x8000, torch.zeros_like(bits), bits)
    return torch.where(bits >= 0x8000, 0xFFFF - bits, bits | 0x8000).to(torch.int64)


def bin_scores(logit_dtype: torch.dtype, temperature: float, device) -> torch.Tensor:
    """fp32 ``[65536]``: the processed score ``value(key).float() / T`` of every key (as transformers divides)."""
    key = torch.arange(NUM_BINS, dtype=torch.int32, device=device)
    bits = torch.where(key >= 0x8000, key - 0x8000, 0xFFFF - key)
    bits = torch.where(bits >= 0x8000, bits - 0x10000, bits).to(torch.int16)
    return bits.view(logit_dtype).float() / temperature


def select_support(counts: torch.Tensor, scores: torch.Tensor, vocab: int, top_k, top_p, min_p) -> "HistogramSupport":
    """From per-row value counts ``[R, 65536]`` (ascending keys) the support (:class:`HistogramSupport`).

    Works in descending key order: ``cnt[j]`` tokens of score ``val[j]``,
    weight ``w[j] = exp(val[j] - max)``. top-k keeps bins up to the first
    whose cumulative count reaches ``min(k, V)``; top-p keeps in bin ``j``
    ``clamp(ceil((p - E_j / Z) / (w_j / Z)), 0, cnt_j)`` tokens (``E_j`` the
    mass before bin j, Z the top-k mass): the tokens whose preceding mass is
    ``< p``; min-p drops bins with ``w_j / Z' < min_p / Z'`` (Z' the top-p
    mass). The kept set is a prefix of bins with only its last bin partial.
    """
    cnt = counts.flip(1).to(torch.int64)
    val = scores.flip(0)
    nonempty = cnt > 0
    first = torch.argmax(nonempty.to(torch.int8), dim=1)
    top = val[first]
    w = torch.where(nonempty, torch.exp((val[None, :] - top[:, None]).double()), torch.zeros((), dtype=torch.float64,
                                                                                             device=cnt.device))
    keep = cnt
    j = torch.arange(NUM_BINS, device=cnt.device)
    if top_k is not None:
        reached = cnt.cumsum(1) >= min(top_k, vocab)
        jk = torch.argmax(reached.to(torch.int8), dim=1)
        keep = torch.where(j[None, :] <= jk[:, None], keep, torch.zeros_like(keep))
    if top_p is not None:
        mass = keep.double() * w
        total = mass.sum(1, keepdim=True)
        before = (mass.cumsum(1) - mass) / total
        per_token = w / total
        n = torch.ceil((top_p - before) / per_token)
        n = torch.nan_to_num(n, nan=0.0, posinf=float(vocab), neginf=0.0)
        keep = torch.minimum(n.clamp(min=0.0), keep.double()).to(torch.int64)
    if min_p is not None:
        total = (keep.double() * w).sum(1, keepdim=True)
        drop = (w / total) < min_p * (1.0 / total)
        keep = torch.where(drop, torch.zeros_like(keep), keep)
    last = NUM_BINS - 1 - torch.argmax((keep > 0).flip(1).to(torch.int8), dim=1)
    r = keep.gather(1, last[:, None]).squeeze(1)
    c = cnt.gather(1, last[:, None]).squeeze(1)
    mass = (keep.double() * w).sum(1)
    return HistogramSupport(NUM_BINS - 1 - last, r, c, top, mass)


def head_logits(head: HeadInputs, logit_dtype) -> torch.Tensor:
    """``[N, V']`` logits of ``head`` in ``logit_dtype`` (the lm_head op, positions already checked)."""
    return lm_head_logits(head.hidden, head.weight, norm_weight=head.norm_weight, eps=head.eps,
                          positions=head.positions, check_bounds=False, logit_dtype=logit_dtype, softcap=head.softcap)


def gumbel(shape, generator, device) -> torch.Tensor:
    u = torch.rand(shape, generator=generator, device=device, dtype=torch.float32)
    return -torch.log(-torch.log(u.clamp_min(torch.finfo(torch.float32).tiny)))


def noise_source(generator, seed: Optional[torch.Tensor], device):
    """``noise(row0, n_rows, v0, v1)`` -> fp32 ``[n_rows, v1 - v0]`` Gumbel noise: from ``generator``
    (``torch.rand``, consumed in call order), or keyed by the device ``seed`` tensor (a pure function of
    (seed, output row, vocab id))."""
    if seed is not None:
        return lambda row0, n_rows, v0, v1: gumbel_noise_block(seed, row0, n_rows, v0, v1 - v0)
    return lambda row0, n_rows, v0, v1: gumbel((n_rows, v1 - v0), generator, device)


@dataclasses.dataclass
class HistogramSupport:
    """The processed distribution's support per row, from the value histogram (module docstring).

    ``R`` rows: the support is every token whose key is above ``key_star``
    plus the ``r`` highest ids among the ``count`` tokens at ``key_star``
    (int64 ``[R]`` each); ``top`` (fp32 ``[R]``) is the row's largest processed
    score and ``mass`` (fp64 ``[R]``) ``sum over the support of exp(s - top)``,
    so a supported token's probability is ``exp(s - top) / mass``.
    """

    key_star: torch.Tensor
    r: torch.Tensor
    count: torch.Tensor
    top: torch.Tensor
    mass: torch.Tensor

    def chunk_mask(self, keys: torch.Tensor, seen: torch.Tensor):
        """``(support [R, Vc] bool, seen')`` of a vocab chunk's ``keys [R, Vc]``; ``seen`` (int64 ``[R]``) counts the
        tokens at ``key_star`` in the chunks before (start at 0, chunks in id order)."""
        tie = keys == self.key_star[:, None]
        greater = self.count[:, None] - (seen[:, None] + tie.to(torch.int64).cumsum(1))  # tied tokens with a larger id
        support = (keys > self.key_star[:, None]) | (tie & (greater < self.r[:, None]))
        return support, seen + tie.sum(1)


def histogram_support(head: HeadInputs, t, top_k, top_p, min_p, logit_dtype, vocab_chunk: int,
                      scores_of_bins) -> HistogramSupport:
    """Pass 1 and the selection (module docstring) for the rows of ``head``, ``vocab_chunk`` ids at a
    time; ``scores_of_bins``: :func:`bin_scores` of ``logit_dtype`` and ``t``."""
    V = head.vocab
    device = head.hidden.device
    counts = torch.zeros(head.rows, NUM_BINS, dtype=torch.int32, device=device)
    for v0 in range(0, V, vocab_chunk):
        v1 = min(V, v0 + vocab_chunk)
        keys = value_keys(head_logits(head.vocab_chunk(v0, v1), logit_dtype))
        counts.scatter_add_(1, keys, torch.ones(keys.shape, dtype=torch.int32, device=device))
    return select_support(counts, scores_of_bins, V, top_k, top_p, min_p)


class ProcessedChunks:
    """One head's processed distribution over a row group, served one vocabulary chunk at a time.

    ``chunk(v0, v1)`` -> ``(p [R, v1 - v0] fp32, scores [R, v1 - v0] fp32)``: the
    probabilities (0 off the support) and the processed scores (``-inf`` off
    the support); chunks must come in id order, each once per pass (the tie
    ranks are a running count).
    """

    def __init__(self, head: HeadInputs, t, filters, logit_dtype, vocab_chunk: int):
        self.head, self.t, self.filters, self.logit_dtype = head, t, filters, logit_dtype
        self.histogram = logit_dtype in HALF_DTYPES
        if self.histogram:
            bins = bin_scores(logit_dtype, t, head.hidden.device)
            self.support = histogram_support(head, t, *filters, logit_dtype, vocab_chunk, bins)
            self.seen = torch.zeros(head.rows, dtype=torch.int64, device=head.hidden.device)
            self.mass = self.support.mass.float()

    def chunk(self, v0: int, v1: int) -> Tuple[torch.Tensor, torch.Tensor]:
        """``(p, scores)`` of ids ``v0:v1`` (the class docstring)."""
        if not self.histogram:  # full-vocabulary rows (v0 = 0, v1 = V): the reference warpers
            s = processed_scores(head_logits(self.head, self.logit_dtype), self.t, *self.filters)
            return torch.softmax(s, dim=1), s
        logits = head_logits(self.head.vocab_chunk(v0, v1), self.logit_dtype)
        support, self.seen = self.support.chunk_mask(value_keys(logits), self.seen)
        s = torch.where(support, logits.float() / self.t, float("-inf"))
        return torch.exp(s - self.support.top[:, None]) / self.mass[:, None], s
