"""The sampling head :func:`lm_head_sample`: one draw per row, plain or from transformers' processed distribution.

Its route follows the normalized filters (:func:`dflash_kernels.reference.sampling.check_sampling_args`): none
(``top_k`` None / 0, ``top_p`` None / 1, ``min_p`` None) draws from ``softmax(logits / T)`` with Gumbel noise
fused into the lm_head GEMM (:func:`dflash_kernels.lm_head.sample_gumbel`, ops ``dflash::lm_head_sample``);
any filter given (``min_p=0.0`` counts as given: it keeps every token, through this route) draws from the
processed distribution (temperature, top-k, top-p, min-p), chunked as follows (op
``dflash::lm_head_sample_processed``).

The math is :mod:`dflash_kernels.reference.sampling` (the warpers exactly as
transformers applies them, then one draw from the softmax). This module draws
from the same distribution without ever holding the ``[N, V]`` logits.

Shapes: ``hidden [T, H]``, ``weight [V, H]``, ``norm_weight [H]``, ``positions [N]``;
result int64 ``[N]``. Logits: :func:`dflash_kernels.lm_head_logits` of vocab
chunks (``weight[v0:v1]``, fp32 accumulation, rounded to ``logit_dtype``,
optional softcap before the rounding), so a chunk's logits are bit-equal to
those :func:`dflash_kernels.lm_head_argmax` compares.

For ``logit_dtype`` bf16 / fp16 (every half-precision model) the support of the processed distribution
comes from a per-row histogram of the 16-bit logit values (:mod:`dflash_kernels.distribution`, shared with
:mod:`dflash_kernels.rejection`: pass 1 counts, then an exact selection gives per row a boundary key ``key*``
and a tie count ``r``), then:

Pass 2 (vocab chunks, logits recomputed): Gumbel-max restricted to the
support, ``argmax(s + G)``, ``G = -log(-log U)``, U from ``torch.rand`` with
the call's generator (``seed`` seeds a private one): an exact draw from
``softmax(s)`` over the support. With a device seed tensor
(``seed=`` an int64 tensor ``[1]``) ``G`` is instead the counter-based
noise :func:`dflash_kernels.noise.gumbel_noise_block` of (seed value, output row, vocab
id), generated on the device by a Triton launch that reads the seed from
memory: the same noise as the reference's, so both backends draw the same
token from bit-equal logits. The rank of a tied token at ``key*`` is a
running per-row count over the chunks (fixed shapes).

Memory: one ``[R, Vc]`` logits chunk (``R * Vc <= chunk_elements``, default
:data:`dflash_kernels.distribution.DEFAULT_CHUNK_ELEMENTS`, plus the same of noise in pass 2) and the
``[R, 65536]`` histogram with its selection temporaries (about 2 MiB per row),
R <= :data:`dflash_kernels.distribution.HISTOGRAM_ROWS` rows at a time: independent of V and of k / p.
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

from typing import Optional

import torch

from torch import Tensor

from ._declare import declare, dispatch
from .distribution import (bin_scores, head_logits, histogram_support, noise_source,
                           sample_processed_plan, value_keys)
from .lm_head import _token_rows, sample_gumbel
from .reference import sampling as _reference
from .reference.lm_head import HeadInputs, check_seed_tensor, check_temperature, head_inputs, resolve_logit_dtype
from .reference.sampling import check_sampling_args, processed_scores

__all__ = ["lm_head_sample"]

def _histogram_rows(head: HeadInputs, t, top_k, top_p, min_p, logit_dtype, noise, row0, plan, scores_of_bins):
    """Tokens ``[R]`` of one row chunk by the histogram method (module docstring, steps 1-3)."""
    V = head.vocab
    R = head.rows
    device = head.hidden.device
    vc = plan["vocab"]
    support_of = histogram_support(head, t, top_k, top_p, min_p, logit_dtype, vc, scores_of_bins)
    seen = torch.zeros(R, dtype=torch.int64, device=device)
    best = torch.full((R,), float("-inf"), dtype=torch.float32, device=device)
    best_id = torch.zeros(R, dtype=torch.int64, device=device)
    for v0 in range(0, V, vc):
        v1 = min(V, v0 + vc)
        logits = head_logits(head.vocab_chunk(v0, v1), logit_dtype)
        s = logits.float() / t
        support, seen = support_of.chunk_mask(value_keys(logits), seen)
        score = torch.where(support, s + noise(row0, R, v0, v1), float("-inf"))
        val, idx = score.max(dim=1)
        better = val > best
        best = torch.where(better, val, best)
        best_id = torch.where(better, idx + v0, best_id)
    return best_id


def _dense_rows(head: HeadInputs, t, top_k, top_p, min_p, logit_dtype, noise, row0):
    """Tokens ``[R]`` of one row chunk from its full-vocabulary logits (the fp32-logit path)."""
    logits = head_logits(head, logit_dtype)
    s = processed_scores(logits, t, top_k, top_p, min_p)
    return torch.argmax(s + noise(row0, s.shape[0], 0, s.shape[1]), dim=1)


def lm_head_sample(hidden, weight, temperature, *, top_k=None, top_p=None, min_p=None, norm_weight=None, eps=1e-6,
                   positions=None, generator=None, seed=None, check_bounds=True, logit_dtype=None, softcap=None,
                   chunk_elements: Optional[int] = None, backend=None) -> torch.Tensor:
    """int64 ``[N]``: one token per row drawn from the (processed) distribution of the head's logits.

    ``logits = rms_norm(hidden[positions]) @ weight.T`` (fp32 accumulation; ``softcap`` c: ``c * tanh(logits /
    c)``), rounded to ``logit_dtype`` (default None: the dtype ``F.linear`` returns, as
    :func:`dflash_kernels.lm_head_argmax`; transformers samples from those rounded logits), then temperature
    ``T > 0`` (use :func:`dflash_kernels.lm_head_argmax` for greedy) and the filters, then one draw.

    No filter: :func:`dflash_kernels.lm_head.sample_gumbel`, a draw from ``softmax(logits / T)``. A filter
    (``top_k``, ``top_p``, ``min_p``; ``min_p=0.0`` included): the processed distribution, below.
    ``seed`` (int) or ``generator`` make a draw reproducible; ``seed`` an int64 tensor ``[1]`` / ``[]`` on
    hidden's device (a compiled / CUDA-graph step) is read in-kernel: ``token[n] = argmax_j(s[n, j] + G(seed,
    n, j))``, ``G`` the counter-based Gumbel noise of :func:`dflash_kernels.reference.gumbel_noise`, the same
    noise on both backends. ``chunk_elements`` bounds one logits chunk of the processed route. ``backend``:
    'triton' or 'reference' to fix the backend, None: :func:`dflash_kernels.get_backend`.
    """
    if not _filtered(top_k, top_p, min_p):
        return sample_gumbel(hidden, weight, temperature, norm_weight=norm_weight, eps=eps, positions=positions,
                             generator=generator, seed=seed, check_bounds=check_bounds, logit_dtype=logit_dtype,
                             softcap=softcap, backend=backend)
    return sample_processed(hidden, weight, temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                            norm_weight=norm_weight, eps=eps, positions=positions, seed=seed, generator=generator,
                            logit_dtype=logit_dtype, softcap=softcap, check_bounds=check_bounds,
                            chunk_elements=chunk_elements, backend=backend)


def _filtered(top_k, top_p, min_p) -> bool:
    """Whether a filter is on once normalized (top-k 0 and top-p 1 are off; any ``min_p`` is on). A bad value
    routes to the processed path, which reports it after its own earlier checks."""
    try:
        return check_sampling_args(top_k, top_p, min_p) != (None, None, None)
    except (TypeError, ValueError):
        return True


def sample_processed(hidden, weight, temperature, *, top_k=None, top_p=None, min_p=None, norm_weight=None,
                     eps=1e-6, positions=None, seed=None, generator=None, logit_dtype=None, softcap=None,
                     check_bounds=True, chunk_elements: Optional[int] = None, backend=None) -> torch.Tensor:
    """:func:`lm_head_sample` with filters: int64 ``[N]``, one token per row from transformers' processed
    distribution of the logits.

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
    (``s`` the processed scores), ``G`` = :func:`dflash_kernels.noise.gumbel_noise_block`:
    a pure function of the seed's value, the output row and the vocab id, made
    on the device (the seed is never read on the host), so a captured graph
    replays new noise when the caller changes the seed tensor; the same noise
    on both backends. ``check_bounds=False`` reads nothing on the host. The reference
    backend runs the reference (dense logits, ``torch.multinomial``); the
    Triton backend the chunked method of the module docstring.
    ``chunk_elements`` bounds one logits chunk (default :data:`dflash_kernels.distribution.DEFAULT_CHUNK_ELEMENTS`).
    ``backend``: 'triton' or 'reference' to fix the backend (a compiled round
    does), None: :func:`dflash_kernels.get_backend`.
    """
    head = head_inputs(hidden, weight, norm_weight, eps, positions, softcap, check_bounds=check_bounds)
    t = check_temperature(temperature)
    top_k, top_p, min_p = check_sampling_args(top_k, top_p, min_p)
    logit_dtype = resolve_logit_dtype(hidden, weight, logit_dtype)
    if generator is not None and seed is not None:
        raise ValueError("pass either generator or seed to lm_head_sample, not both")
    device_seed = isinstance(seed, torch.Tensor)
    if device_seed:
        seed = check_seed_tensor(seed, hidden.device, "lm_head_sample")
    elif seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise TypeError(f"seed must be an int or an int64 tensor [1], got {type(seed).__name__}")

    def traced():
        if not device_seed:
            raise TypeError("lm_head_sample under torch.compile takes seed as an int64 tensor [1] on hidden's "
                            f"device (a generator or an int seed draws on the host), got {type(seed).__name__}")
        return torch.ops.dflash.lm_head_sample_processed(hidden, weight, t, top_k, top_p, min_p, seed, norm_weight,
                                                         head.positions, eps, logit_dtype, head.softcap)

    return dispatch(
        backend, hidden.device, traced=traced,
        reference=lambda: _reference.lm_head_sample_processed(
            hidden, weight, t, top_k=top_k, top_p=top_p, min_p=min_p, norm_weight=norm_weight, eps=eps,
            positions=head.positions, seed=seed, generator=generator, logit_dtype=logit_dtype, softcap=head.softcap,
            check_bounds=False),
        triton=lambda: _sample_processed_triton(head.detached(), t, top_k, top_p, min_p, seed, generator,
                                                logit_dtype, chunk_elements))


def _sample_processed_triton(head: HeadInputs, t, top_k, top_p, min_p, seed, generator, logit_dtype,
                             chunk_elements):
    """The chunked method of the module docstring (arguments checked, ``head`` detached)."""
    device_seed = isinstance(seed, torch.Tensor)
    device = head.hidden.device
    N = head.rows
    out = torch.empty(N, dtype=torch.int64, device=device)
    if N == 0:
        return out
    if seed is not None and not device_seed:
        generator = torch.Generator(device=device)
        generator.manual_seed(seed % (2 ** 63))
    noise = noise_source(generator, seed if device_seed else None, device)
    plan = sample_processed_plan(N, head.vocab, logit_dtype, chunk_elements)
    scores_of_bins = bin_scores(logit_dtype, t, device) if plan["method"] == "histogram" else None
    for r0 in range(0, N, plan["rows"]):
        r1 = min(N, r0 + plan["rows"])
        rows = head.row_chunk(r0, r1)
        if plan["method"] == "histogram":
            out[r0:r1] = _histogram_rows(rows, t, top_k, top_p, min_p, logit_dtype, noise, r0, plan, scores_of_bins)
        else:
            out[r0:r1] = _dense_rows(rows, t, top_k, top_p, min_p, logit_dtype, noise, r0)
    return out


@declare("lm_head_sample_processed", fake=_token_rows)
def _lm_head_sample_processed_op(hidden: Tensor, weight: Tensor, temperature: float, top_k: Optional[int],
                                 top_p: Optional[float], min_p: Optional[float], seed: Tensor,
                                 norm_weight: Optional[Tensor] = None, positions: Optional[Tensor] = None,
                                 eps: float = 1e-6, logit_dtype: Optional[torch.dtype] = None,
                                 softcap: Optional[float] = None) -> Tensor:
    """:func:`sample_processed` with ``seed=`` a device tensor: int64 ``[N]`` draws from the processed
    distribution (temperature, top-k, top-p, min-p; all off is still this route); ``positions`` are not
    range-checked."""
    return sample_processed(hidden, weight, temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                            norm_weight=norm_weight, eps=eps, positions=positions, seed=seed,
                            logit_dtype=logit_dtype, softcap=softcap, check_bounds=False)
