"""Rejection sampling of a drafted chain, chunked over the vocabulary (no ``[rows, V]`` probabilities).

The math, shapes and noise are :mod:`dflash_kernels.reference.rejection`'s:
accept ``x_k`` while ``u_k q_k(x_k) < p_k(x_k)``, then one draw from
``normalize(max(p_a - q_a, 0))`` at the first rejected row ``a`` (``p_D``
when all ``D`` drafts are accepted), ``q`` dense (the drafter's rows through
the lm_head, processed as the target's) or sparse (``q_ids`` / ``q_probs``).

Each row's draw does not depend on ``a``, so every row ``k = 0..D`` is done in
the same pass and ``a`` only picks among them at the end (fixed shapes, no
host read). Per row group (every row at once unless the budget says otherwise):

1. the processed distribution's support and normalizer per row, for the
   target's rows and (dense) the drafter's: for half-precision logits the
   histogram method of :mod:`dflash_kernels.distribution`
   (:func:`~dflash_kernels.distribution.histogram_support`: support = a boundary
   value and a tie count, ``p(v) = exp(s_v - top) / mass``), one pass over
   the lm_head weight; fp32 logits take full-vocabulary row chunks and the
   reference warpers (the sampler's dense path);
2. one pass over vocabulary chunks (logits recomputed): the chunk's ``p`` and
   ``q`` (sparse: ``q_probs`` scattered into the chunk), ``p_k(x_k)`` and
   ``q_k(x_k)`` accumulated where ``x_k`` falls in the chunk, and two running
   Gumbel-max draws with the chunk's noise
   (:func:`dflash_kernels.noise.gumbel_noise_block`, keyed by (seed, row,
   vocab id) like the reference): one from the residual ``max(p - q, 0)``
   (``log`` of it plus the noise) and one from ``p`` (its processed scores
   plus the same noise) for a row whose residual is all zero (``p = q``) and
   for the bonus row ``D`` (``q_D = 0``), plus the residual's running sum.

Then the acceptance uniforms (``exp(-exp(-G(seed, k, V)))``, one noise
launch), ``a`` and the choices. Memory: a few ``[R, Vc]`` chunks (``R * Vc <=
chunk_elements`` per head) and, for half logits, the ``[R, 65536]``
histogram; cost: two passes over the weight for the ``2D + 1`` rows, the same
GEMMs as the sampler's. The epilogue is torch ops on the chunk (the GEMM
dominates); the dense draft's logits are the ones its sample was drawn from
(the same op on the same rows), so ``q`` is the proposal distribution.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from torch import Tensor

from ._declare import declare, dispatch
from .distribution import (DEFAULT_CHUNK_ELEMENTS, HALF_DTYPES, HISTOGRAM_ROWS, ProcessedChunks,
                           sample_processed_plan)
from .noise import gumbel_noise_block
from .reference import rejection as _reference
from .reference.lm_head import HeadInputs, check_temperature, head_inputs, resolve_logit_dtype
from .reference.sampling import check_sampling_args

__all__ = ["rejection_sample"]


def _sparse_chunk(q_ids: torch.Tensor, q_probs: torch.Tensor, rows: int, v0: int, v1: int) -> torch.Tensor:
    """fp32 ``[rows, v1 - v0]``: the sparse ``q`` of ``q_ids`` / ``q_probs`` (``[n, K]``, ``n <= rows``; rows past
    ``n`` are 0) restricted to ids ``v0:v1``."""
    out = torch.zeros(rows, v1 - v0, dtype=torch.float32, device=q_ids.device)
    inside = (q_ids >= v0) & (q_ids < v1)
    n = q_ids.shape[0]
    out[:n].scatter_add_(1, (q_ids - v0).clamp(0, v1 - v0 - 1), torch.where(inside, q_probs.float(), 0.0))
    return out


def _at(chunk: torch.Tensor, ids: torch.Tensor, v0: int) -> torch.Tensor:
    """fp32 ``[R]``: ``chunk[r, ids[r] - v0]`` where ``ids[r]`` falls in the chunk, else 0."""
    width = chunk.shape[1]
    local = ids - v0
    inside = (local >= 0) & (local < width)
    return torch.where(inside, chunk.gather(1, local.clamp(0, width - 1)[:, None])[:, 0], 0.0)


def _group(target: HeadInputs, q_head: Optional[HeadInputs], q_sparse, proposals, row0: int, t, filters,
           logit_dtype, q_logit_dtype, seed, vocab_chunk: int):
    """``(p(x) [R], q(x) [R], draws [R])`` of rows ``row0 .. row0 + R - 1`` (module docstring, steps 1-2)."""
    R, V, D = target.rows, target.vocab, proposals.shape[0]
    device = target.hidden.device
    nq = max(0, min(D - row0, R))  # rows of this group that have a draft (the bonus row D has none)
    x = torch.cat([proposals, proposals.new_full((1,), -1)])[row0:row0 + R]  # -1: no draft at row D
    p_of = ProcessedChunks(target, t, filters, logit_dtype, vocab_chunk)
    q_of = None if q_head is None or nq == 0 else ProcessedChunks(q_head, t, filters, q_logit_dtype, vocab_chunk)
    zeros = lambda: torch.zeros(R, dtype=torch.float32, device=device)  # noqa: E731
    px, qx, res_total = zeros(), zeros(), zeros()
    best_res, best_p = torch.full((R,), float("-inf"), device=device), torch.full((R,), float("-inf"), device=device)
    id_res = torch.zeros(R, dtype=torch.int64, device=device)
    id_p = torch.zeros(R, dtype=torch.int64, device=device)
    for v0 in range(0, V, vocab_chunk):
        v1 = min(V, v0 + vocab_chunk)
        p, s = p_of.chunk(v0, v1)
        if q_of is not None:
            q = torch.zeros_like(p)
            q[:nq] = q_of.chunk(v0, v1)[0]
        elif q_sparse is not None and nq > 0:
            q = _sparse_chunk(q_sparse[0][row0:row0 + nq], q_sparse[1][row0:row0 + nq], R, v0, v1)
        else:
            q = torch.zeros_like(p)
        px = px + _at(p, x, v0)
        qx = qx + _at(q, x, v0)
        residual = (p - q).clamp_min(0.0)
        res_total = res_total + residual.sum(1)
        noise = gumbel_noise_block(seed, row0, R, v0, v1 - v0)
        for score, best, ids in ((torch.log(residual) + noise, best_res, id_res), (s + noise, best_p, id_p)):
            val, idx = score.max(dim=1)
            better = val > best
            best.copy_(torch.where(better, val, best))
            ids.copy_(torch.where(better, idx + v0, ids))
    return px, qx, torch.where(res_total > 0, id_res, id_p)


def _rejection_fast(target: HeadInputs, q_head, q_sparse, proposals, t, filters, logit_dtype, q_logit_dtype, seed,
                    chunk_elements):
    D, V = proposals.shape[0], target.vocab
    budget = max(1, int(chunk_elements or DEFAULT_CHUNK_ELEMENTS))
    dense = logit_dtype not in HALF_DTYPES or (q_head is not None and q_logit_dtype not in HALF_DTYPES)
    if dense:  # full-vocabulary rows: as many as the budget holds
        rows, vocab_chunk = max(1, min(D + 1, budget // V)), V
    else:
        plan = sample_processed_plan(min(D + 1, HISTOGRAM_ROWS), V, logit_dtype, budget)
        rows, vocab_chunk = plan["rows"], plan["vocab"]
    px, qx, draws = [], [], []
    for r0 in range(0, D + 1, rows):
        r1 = min(D + 1, r0 + rows)
        q_rows = None if q_head is None or r0 >= D else q_head.row_chunk(r0, min(r1, D))
        out = _group(target.row_chunk(r0, r1), q_rows, q_sparse, proposals, r0, t, filters, logit_dtype,
                     q_logit_dtype, seed, vocab_chunk)
        px.append(out[0])
        qx.append(out[1])
        draws.append(out[2])
    px, qx, y = torch.cat(px)[:D], torch.cat(qx)[:D], torch.cat(draws)
    g = gumbel_noise_block(seed, 0, D, V, 1)[:, 0]
    u = torch.exp(-torch.exp(-g))
    accepted = torch.cumprod((u * qx < px).long(), 0).sum().reshape(1)
    k = torch.arange(D + 1, device=proposals.device)
    choices = torch.where(k < accepted, torch.cat([proposals, proposals.new_zeros(1)]), y)
    return choices, accepted


def rejection_sample(hidden, weight, proposals, temperature, *, q_hidden=None, q_ids=None, q_probs=None, top_k=None,
                     top_p=None, min_p=None, norm_weight=None, eps=1e-6, softcap=None, seed=None, logit_dtype=None,
                     q_logit_dtype=None, check_bounds=True, chunk_elements: Optional[int] = None,
                     backend=None) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(choices [D + 1] int64, accepted [1] int64)``: the lossless acceptance of a drafted chain.

    ``hidden [D + 1, H]`` the target's verify rows (``norm_weight`` / ``eps``
    / ``softcap`` as every lm_head op), ``weight [V, H]``, ``proposals [D]``
    the drafts, ``temperature`` / ``top_k`` / ``top_p`` / ``min_p`` the
    processed distribution of the target (and of a dense draft), the draft
    distribution as ``q_hidden [D, H]`` (dense) or ``q_ids`` / ``q_probs``
    ``[D, K]`` (sparse), ``seed`` an int64 tensor ``[1]`` on hidden's device
    (never read on the host). ``accepted`` = ``a``, the accepted prefix;
    ``choices[:a]`` are the accepted drafts and ``choices[a]`` the corrected
    (or, for ``a = D``, the bonus) token. The math:
    :mod:`dflash_kernels.reference.rejection`; the chunked method: the module
    docstring. ``check_bounds=False`` reads nothing on the host.
    ``chunk_elements`` bounds one logits chunk (default
    :data:`dflash_kernels.distribution.DEFAULT_CHUNK_ELEMENTS`). ``backend``:
    'triton' or 'reference' (None: :func:`dflash_kernels.get_backend`).
    """
    head = head_inputs(hidden, weight, norm_weight, eps, None, softcap, check_bounds=False)
    seed = _reference.check_rejection_args(hidden, weight, proposals, q_hidden, q_ids, q_probs, seed,
                                           check_bounds=check_bounds)
    t = check_temperature(temperature)
    filters = check_sampling_args(top_k, top_p, min_p)
    logit_dtype = resolve_logit_dtype(hidden, weight, logit_dtype)
    q_logit_dtype = None if q_hidden is None else resolve_logit_dtype(q_hidden, weight, q_logit_dtype)

    def triton_path():
        fast = head.detached()
        q_head = None if q_hidden is None else HeadInputs(q_hidden.detach(), fast.weight, None, eps, None, None)
        q_sparse = None if q_ids is None else (q_ids, q_probs.detach())
        return _rejection_fast(fast, q_head, q_sparse, proposals, t, filters, logit_dtype, q_logit_dtype, seed,
                               chunk_elements)

    return dispatch(
        backend, hidden.device, triton=triton_path,
        reference=lambda: _reference.rejection_sample(
            hidden, weight, proposals, t, q_hidden=q_hidden, q_ids=q_ids, q_probs=q_probs, top_k=filters[0],
            top_p=filters[1], min_p=filters[2], norm_weight=norm_weight, eps=eps, softcap=head.softcap, seed=seed,
            logit_dtype=logit_dtype, q_logit_dtype=q_logit_dtype, check_bounds=False),
        traced=lambda: torch.ops.dflash.rejection_sample(
            hidden, weight, proposals, t, filters[0], filters[1], filters[2], seed.reshape(1), q_hidden, q_ids,
            q_probs, norm_weight, eps, logit_dtype, q_logit_dtype, head.softcap))


@declare("rejection_sample", fake=lambda a: (a.proposals.new_empty(a.proposals.shape[0] + 1),
                                             a.proposals.new_empty(1)))
def _rejection_sample_op(hidden: Tensor, weight: Tensor, proposals: Tensor, temperature: float,
                         top_k: Optional[int], top_p: Optional[float], min_p: Optional[float], seed: Tensor,
                         q_hidden: Optional[Tensor] = None, q_ids: Optional[Tensor] = None,
                         q_probs: Optional[Tensor] = None, norm_weight: Optional[Tensor] = None, eps: float = 1e-6,
                         logit_dtype: Optional[torch.dtype] = None, q_logit_dtype: Optional[torch.dtype] = None,
                         softcap: Optional[float] = None) -> Tuple[Tensor, Tensor]:
    """:func:`rejection_sample` (``seed`` a device tensor): ``(choices [D + 1] int64, accepted [1] int64)``; ids
    are not range-checked."""
    return rejection_sample(hidden, weight, proposals, temperature, q_hidden=q_hidden, q_ids=q_ids,
                            q_probs=q_probs, top_k=top_k, top_p=top_p, min_p=min_p, norm_weight=norm_weight,
                            eps=eps, softcap=softcap, seed=seed, logit_dtype=logit_dtype,
                            q_logit_dtype=q_logit_dtype, check_bounds=False)
