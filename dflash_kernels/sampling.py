"""Sampling from transformers' processed distribution (temperature, top-k, top-p, min-p), chunked.

The math is :mod:`dflash_kernels.reference.sampling` (the warpers exactly as
transformers applies them, then one draw from the softmax). This module draws
from the same distribution without ever holding the ``[N, V]`` logits.

Shapes: ``hidden [T, H]``, ``weight [V, H]``, ``norm_weight [H]``, ``positions [N]``;
result int64 ``[N]``. Logits: :func:`dflash_kernels.lm_head_logits` of vocab
chunks (``weight[v0:v1]``, fp32 accumulation, rounded to ``logit_dtype``,
optional softcap before the rounding), so a chunk's logits are bit-equal to
those :func:`dflash_kernels.lm_head_argmax` compares.

Why a histogram, not a top-K buffer. Top-p's kept set is a prefix of the
vocabulary in (score desc, id desc) order whose length is unbounded (a flat
distribution keeps about ``p * V`` tokens), and bf16 ties at the k-th value
make even top-k's set larger than k. But a 16-bit logit has at most 2**16
distinct values, and the processed score ``x / T`` depends on that value
only. So for ``logit_dtype`` bf16 / fp16 (every half-precision model):

1. pass 1 (vocab chunks): per row, the count of tokens at each of the 65536
   values (``counts [R, 65536]`` int32; the 16-bit pattern mapped to an
   order-preserving key, -0 merged with +0);
2. selection, exact in integers and the bins' masses ``count * exp(s_b - max)``
   (cumulative masses in fp64): top-k = the bins down to the one where the
   cumulative count reaches k (ties all kept); top-p = per bin the number of
   tokens whose preceding mass is ``< p`` (ties at the cut: the highest ids,
   see the reference); min-p = bins with ``P_b >= min_p * P_max``. The result
   per row is a boundary value ``key*`` and a count ``r``: the support is every
   token above ``key*`` plus the ``r`` highest ids at ``key*``;
3. pass 2 (vocab chunks, logits recomputed): Gumbel-max restricted to the
   support, ``argmax(s + G)``, ``G = -log(-log U)``, U from ``torch.rand`` with
   the call's generator (``seed`` seeds a private one): an exact draw from
   ``softmax(s)`` over the support. With a device seed tensor
   (``seed=`` an int64 tensor ``[1]``) ``G`` is instead the counter-based
   noise :func:`dflash_kernels.lm_head.gumbel_noise_block` of (seed value, output row, vocab
   id), generated on the device by a Triton launch that reads the seed from
   memory: the same noise as the reference's, so both backends draw the same
   token from bit-equal logits. The rank of a tied token at ``key*`` is a
   running per-row count over the chunks (fixed shapes).

Memory: one ``[R, Vc]`` logits chunk (``R * Vc <= chunk_elements``, default
:data:`DEFAULT_CHUNK_ELEMENTS`, plus the same of noise in pass 2) and the
``[R, 65536]`` histogram with its selection temporaries (about 2 MiB per row),
R <= :data:`HISTOGRAM_ROWS` rows at a time: independent of V and of k / p.
Cost: two passes over the lm_head weight.

fp32 logits (``logit_dtype=torch.float32``; fp32 models) have 2**32 values:
there the op takes row chunks of the full-vocabulary fp32 logits (``R * V <=
chunk_elements``, R >= 1) and applies the reference warpers to each chunk on
the device (sort included), then Gumbel-max: the dense path, whose chunk is
bounded by the same budget.

No host synchronization anywhere in the op (no ``.item()``, ``nonzero``,
boolean indexing, data-dependent shapes): every shape follows from N, V and
the budget, so the loops can call it inside a captured round. Reproducible for
a given ``seed`` and call shape. Float note: the cumulative masses are summed
in a different order than transformers' fp32 ``cumsum`` over the sorted
vocabulary, so a token whose preceding mass equals ``p`` to within rounding may
fall on the other side of the cut; everything else is exact.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from ._dispatch import resolve_backend, tracing
from .lm_head import gumbel_noise_block, lm_head_logits
from .reference import sampling as _reference
from .reference.lm_head import HeadInputs, check_seed_tensor, check_temperature, head_inputs, resolve_logit_dtype
from .reference.sampling import check_sampling_args, processed_scores

# (sample_processed_plan: a planning helper, imported from this module)
__all__ = ["lm_head_sample_processed"]

#: fp32 values per logits chunk (and per noise chunk): 2**25 = 128 MiB.
DEFAULT_CHUNK_ELEMENTS = 1 << 25
#: Rows whose 65536-bin histograms are built at once.
HISTOGRAM_ROWS = 64
NUM_BINS = 1 << 16
_HALF_DTYPES = (torch.bfloat16, torch.float16)


def sample_processed_plan(n_rows: int, vocab: int, logit_dtype: torch.dtype,
                          chunk_elements: Optional[int] = None) -> dict:
    """How the op chunks ``n_rows`` rows: ``method`` ('histogram' or 'dense'), ``rows`` per chunk, ``vocab``
    ids per chunk, and ``logits_elements`` (the largest logits chunk, ``rows * vocab <= chunk_elements``)."""
    budget = max(1, int(chunk_elements or DEFAULT_CHUNK_ELEMENTS))
    n_rows = max(1, int(n_rows))
    if logit_dtype in _HALF_DTYPES:
        rows = min(n_rows, HISTOGRAM_ROWS)
        vc = vocab if rows * vocab <= budget else min(vocab, max(256, budget // rows // 256 * 256))
        return dict(method="histogram", rows=rows, vocab=vc, logits_elements=rows * vc)
    rows = max(1, min(n_rows, budget // vocab))
    return dict(method="dense", rows=rows, vocab=vocab, logits_elements=rows * vocab)


# --------------------------------------------------------------------------- 16-bit keys


def _keys(logits: torch.Tensor) -> torch.Tensor:
    """int64 order-preserving key in [0, 65536) of bf16 / fp16 ``logits`` (-0 and +0 share 0x8000)."""
    bits = logits.view(torch.int16).to(torch.int32) & 0xFFFF
    bits = torch.where(bits == 0x8000, torch.zeros_like(bits), bits)
    return torch.where(bits >= 0x8000, 0xFFFF - bits, bits | 0x8000).to(torch.int64)


def _bin_scores(logit_dtype: torch.dtype, temperature: float, device) -> torch.Tensor:
    """fp32 ``[65536]``: the processed score ``value(key).float() / T`` of every key (as transformers divides)."""
    key = torch.arange(NUM_BINS, dtype=torch.int32, device=device)
    bits = torch.where(key >= 0x8000, key - 0x8000, 0xFFFF - key)
    bits = torch.where(bits >= 0x8000, bits - 0x10000, bits).to(torch.int16)
    return bits.view(logit_dtype).float() / temperature


def _select(counts: torch.Tensor, scores: torch.Tensor, vocab: int, top_k, top_p, min_p) -> "HistogramSupport":
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


def _head_logits(head: HeadInputs, logit_dtype) -> torch.Tensor:
    """``[N, V']`` logits of ``head`` in ``logit_dtype`` (the lm_head op, positions already checked)."""
    return lm_head_logits(head.hidden, head.weight, norm_weight=head.norm_weight, eps=head.eps,
                          positions=head.positions, check_bounds=False, logit_dtype=logit_dtype, softcap=head.softcap)


def _gumbel(shape, generator, device) -> torch.Tensor:
    u = torch.rand(shape, generator=generator, device=device, dtype=torch.float32)
    return -torch.log(-torch.log(u.clamp_min(torch.finfo(torch.float32).tiny)))


def _noise_source(generator, seed: Optional[torch.Tensor], device):
    """``noise(row0, n_rows, v0, v1)`` -> fp32 ``[n_rows, v1 - v0]`` Gumbel noise: from ``generator``
    (``torch.rand``, consumed in call order), or keyed by the device ``seed`` tensor (a pure function of
    (seed, output row, vocab id))."""
    if seed is not None:
        return lambda row0, n_rows, v0, v1: gumbel_noise_block(seed, row0, n_rows, v0, v1 - v0)
    return lambda row0, n_rows, v0, v1: _gumbel((n_rows, v1 - v0), generator, device)


@dataclasses.dataclass
class HistogramSupport:
    """The processed distribution's support per row, from the value histogram (module docstring, step 2).

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
                      bin_scores) -> HistogramSupport:
    """Pass 1 and the selection (module docstring, steps 1-2) for the rows of ``head``, ``vocab_chunk`` ids at a
    time; ``bin_scores``: :func:`_bin_scores` of ``logit_dtype`` and ``t``."""
    V = head.vocab
    device = head.hidden.device
    counts = torch.zeros(head.rows, NUM_BINS, dtype=torch.int32, device=device)
    for v0 in range(0, V, vocab_chunk):
        v1 = min(V, v0 + vocab_chunk)
        keys = _keys(_head_logits(head.vocab_chunk(v0, v1), logit_dtype))
        counts.scatter_add_(1, keys, torch.ones(keys.shape, dtype=torch.int32, device=device))
    return _select(counts, bin_scores, V, top_k, top_p, min_p)


def _histogram_rows(head: HeadInputs, t, top_k, top_p, min_p, logit_dtype, noise, row0, plan, bin_scores):
    """Tokens ``[R]`` of one row chunk by the histogram method (module docstring, steps 1-3)."""
    V = head.vocab
    R = head.rows
    device = head.hidden.device
    vc = plan["vocab"]
    support_of = histogram_support(head, t, top_k, top_p, min_p, logit_dtype, vc, bin_scores)
    seen = torch.zeros(R, dtype=torch.int64, device=device)
    best = torch.full((R,), float("-inf"), dtype=torch.float32, device=device)
    best_id = torch.zeros(R, dtype=torch.int64, device=device)
    for v0 in range(0, V, vc):
        v1 = min(V, v0 + vc)
        logits = _head_logits(head.vocab_chunk(v0, v1), logit_dtype)
        s = logits.float() / t
        support, seen = support_of.chunk_mask(_keys(logits), seen)
        score = torch.where(support, s + noise(row0, R, v0, v1), float("-inf"))
        val, idx = score.max(dim=1)
        better = val > best
        best = torch.where(better, val, best)
        best_id = torch.where(better, idx + v0, best_id)
    return best_id


def _dense_rows(head: HeadInputs, t, top_k, top_p, min_p, logit_dtype, noise, row0):
    """Tokens ``[R]`` of one row chunk from its full-vocabulary logits (the fp32-logit path)."""
    logits = _head_logits(head, logit_dtype)
    s = processed_scores(logits, t, top_k, top_p, min_p)
    return torch.argmax(s + noise(row0, s.shape[0], 0, s.shape[1]), dim=1)


def lm_head_sample_processed(hidden, weight, temperature, *, top_k=None, top_p=None, min_p=None, norm_weight=None,
                             eps=1e-6, positions=None, seed=None, generator=None, logit_dtype=None, softcap=None,
                             check_bounds=True, chunk_elements: Optional[int] = None, backend=None) -> torch.Tensor:
    """int64 ``[N]``: one token per row from transformers' processed distribution of the logits.

    ``logits = rms_norm(hidden[positions]) @ weight.T`` (fp32 accumulation;
    ``softcap`` c: ``c * tanh(logits / c)``), rounded to ``logit_dtype``
    (default: the promotion of hidden's and the weight's dtypes, as
    :func:`lm_head_argmax`), then temperature ``T > 0``, top-k (``top_k``
    None/0: off; ties at the k-th value kept), top-p (``top_p`` in (0, 1],
    None/1: off), min-p (``min_p`` in [0, 1], None: off), exactly as
    transformers' warpers (:mod:`dflash_kernels.reference.sampling`), then one
    draw from the softmax. ``seed`` (int) or ``generator`` (a torch.Generator
    on hidden's device) make it reproducible; neither: the device's default
    generator. ``seed`` an int64 tensor ``[1]`` / ``[]`` on hidden's device:
    ``token[n] = argmax_j(s[n, j] + G(seed, n, j))`` over the processed support
    (``s`` the processed scores), ``G`` = :func:`dflash_kernels.lm_head.gumbel_noise_block`:
    a pure function of the seed's value, the output row and the vocab id, made
    on the device (the seed is never read on the host), so a captured graph
    replays new noise when the caller changes the seed tensor; the same noise
    on both backends. ``check_bounds=False`` reads nothing on the host. The reference
    backend runs the reference (dense logits, ``torch.multinomial``); the
    Triton backend the chunked method of the module docstring.
    ``chunk_elements`` bounds one logits chunk (default :data:`DEFAULT_CHUNK_ELEMENTS`).
    ``backend``: 'triton' or 'reference' to fix the backend (a compiled round
    does), None: :func:`dflash_kernels.get_backend`.
    """
    head = head_inputs(hidden, weight, norm_weight, eps, positions, softcap, check_bounds=check_bounds)
    t = check_temperature(temperature)
    top_k, top_p, min_p = check_sampling_args(top_k, top_p, min_p)
    logit_dtype = resolve_logit_dtype(hidden, weight, logit_dtype)
    if generator is not None and seed is not None:
        raise ValueError("pass either generator or seed to lm_head_sample_processed, not both")
    device_seed = isinstance(seed, torch.Tensor)
    if device_seed:
        seed = check_seed_tensor(seed, hidden.device, "lm_head_sample_processed")
    elif seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise TypeError(f"seed must be an int or an int64 tensor [1], got {type(seed).__name__}")
    if resolve_backend(backend, hidden.device) == "reference":
        return _reference.lm_head_sample_processed(
            hidden, weight, t, top_k=top_k, top_p=top_p, min_p=min_p, norm_weight=norm_weight, eps=eps,
            positions=head.positions, seed=seed, generator=generator, logit_dtype=logit_dtype, softcap=head.softcap,
            check_bounds=False)
    if tracing():
        if not device_seed:
            raise TypeError("lm_head_sample_processed under torch.compile takes seed as an int64 tensor [1] on "
                            f"hidden's device (a generator or an int seed draws on the host), got {type(seed).__name__}")
        return torch.ops.dflash.lm_head_sample_processed(hidden, weight, t, top_k, top_p, min_p, seed, norm_weight,
                                                         head.positions, eps, logit_dtype, head.softcap)
    head = head.detached()
    N = head.rows
    out = torch.empty(N, dtype=torch.int64, device=hidden.device)
    if N == 0:
        return out
    if seed is not None and not device_seed:
        generator = torch.Generator(device=hidden.device)
        generator.manual_seed(seed % (2 ** 63))
    noise = _noise_source(generator, seed if device_seed else None, hidden.device)
    plan = sample_processed_plan(N, head.vocab, logit_dtype, chunk_elements)
    bin_scores = _bin_scores(logit_dtype, t, hidden.device) if plan["method"] == "histogram" else None
    for r0 in range(0, N, plan["rows"]):
        r1 = min(N, r0 + plan["rows"])
        rows = head.row_chunk(r0, r1)
        if plan["method"] == "histogram":
            out[r0:r1] = _histogram_rows(rows, t, top_k, top_p, min_p, logit_dtype, noise, r0, plan, bin_scores)
        else:
            out[r0:r1] = _dense_rows(rows, t, top_k, top_p, min_p, logit_dtype, noise, r0)
    return out
