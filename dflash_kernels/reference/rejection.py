"""Reference rejection sampling of a drafted chain: the lossless acceptance rule of sampled speculative decoding.

Shapes (``D`` drafted positions, ``H`` hidden size, ``V`` vocabulary, ``K``
candidates per position):

* ``hidden [D + 1, H]``: the target's verify rows (row ``k`` predicts the
  token after block position ``k``), through ``norm_weight`` / ``softcap`` as
  every lm_head op; ``weight [V, H]`` the lm_head;
* ``proposals [D]`` int64: the drafted tokens ``x_1..x_D`` (``x_{k+1}`` is
  verified at row ``k``);
* the draft distribution ``q``, one of two forms:

  - dense, ``q_hidden [D, H]``: ``q_k = processed(q_hidden[k] @ weight.T)``,
    the drafter's rows through the same lm_head (no norm, no softcap: the
    drafter's rows are already normed) and the same temperature, top-k,
    top-p, min-p as the target;
  - sparse, ``q_ids [D, K]`` int64 and ``q_probs [D, K]`` float: ``q_k(v) =
    sum_j q_probs[k, j] [q_ids[k, j] = v]`` (a distribution over ``K``
    candidates, e.g. the DFlash2 selector's).

With ``p_k`` the target's processed distribution at row ``k``
(:func:`dflash_kernels.reference.processed_probs`: temperature, then top-k,
top-p, min-p) and ``x = proposals``::

    accept_k  = u_k * q_k(x_k) < p_k(x_k)       (k < D; u_k uniform in [0, 1))
    a         = number of leading accepts        (the accepted prefix, 0..D)
    r_k       = max(p_k - q_k, 0) / sum(...)     (k < D; p_k itself when that sum is 0)
    r_D       = p_D                              (the bonus row: q_D = 0)
    y_k       ~ r_k                              (one draw per row)
    choices   = [x_1..x_a, y_a, y_{a+1}..y_D]    ([D + 1] int64; choices[a] is the corrected / bonus token)

so the committed tokens ``choices[:a + 1]`` are distributed exactly as ``a +
1`` tokens sampled from the target one by one, whatever ``q`` is (Leviathan
et al. 2023; Chen et al. 2023). ``q_k(x) = 0`` never happens for a token
drawn from ``q_k``; if it does, the rule above accepts it iff ``p_k(x) > 0``
(``u * 0 < p``), still lossless for a ``q`` that would never propose it.
``p_k(x) = 0`` is always rejected.

Noise, a pure function of the device ``seed`` (int64 tensor ``[1]``, read
only on the device): ``y_k = argmax_v(log r_k(v) + G(seed, k, v))`` (Gumbel-max,
``G`` = :func:`dflash_kernels.reference.gumbel_noise` of (seed, row ``k``,
vocab id ``v``)), and ``u_k = exp(-exp(-G(seed, k, V)))`` (the noise of the
id just past the vocabulary, mapped back to its uniform: independent of the
draws' noise). The fast path (:func:`dflash_kernels.rejection_sample`) uses the
same noise, so both backends pick the same tokens up to rounding of ``p``,
``q`` (a draw or an acceptance within an ulp of its boundary).

This reference holds ``[D + 1, V]`` probability tensors: the spec, not the
fast path.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from .lm_head import (HeadInputs, check_seed_tensor, check_temperature, gumbel_noise, head_inputs,
                      resolve_logit_dtype)
from .sampling import check_sampling_args, model_logits, processed_probs, processed_scores

__all__ = ["check_rejection_args", "acceptance_uniforms", "draft_probs", "rejection_from_probs", "rejection_sample"]


def check_rejection_args(hidden, weight, proposals, q_hidden, q_ids, q_probs, seed, *, check_bounds: bool = True):
    """Validate the chain and the draft distribution's form; returns ``seed`` as a 0-d int64 tensor.

    Errors name the argument, its shape and what is allowed. ``check_bounds``
    also checks (on the host) that ``proposals`` and ``q_ids`` are vocabulary ids.
    """
    if not isinstance(proposals, torch.Tensor) or proposals.dtype != torch.int64 or proposals.dim() != 1:
        raise TypeError("proposals must be an int64 tensor [D] (the drafted tokens), got "
                        f"{type(proposals).__name__} {getattr(proposals, 'dtype', '')} "
                        f"{tuple(getattr(proposals, 'shape', ()))}")
    D = proposals.shape[0]
    if hidden.dim() != 2 or hidden.shape[0] != D + 1:
        raise ValueError(f"hidden must be [D + 1, H] = [{D + 1}, H] (one verify row per drafted token plus the "
                         f"bonus row), got {tuple(hidden.shape)}")
    if proposals.device != hidden.device:
        raise ValueError(f"proposals is on {proposals.device} but hidden is on {hidden.device}")
    V, H = weight.shape
    dense = q_hidden is not None
    sparse = q_ids is not None or q_probs is not None
    if dense == sparse:
        raise ValueError("give the draft distribution q in exactly one form: q_hidden [D, H] (dense: the drafter's "
                         "rows through the lm_head) or q_ids [D, K] with q_probs [D, K] (sparse)")
    if dense:
        if not isinstance(q_hidden, torch.Tensor) or q_hidden.dim() != 2 or tuple(q_hidden.shape) != (D, H):
            raise ValueError(f"q_hidden must be [D, H] = [{D}, {H}], got {tuple(getattr(q_hidden, 'shape', ()))}")
        if not q_hidden.dtype.is_floating_point:
            raise TypeError(f"q_hidden must be a float tensor, got {q_hidden.dtype}")
        if q_hidden.device != hidden.device:
            raise ValueError(f"q_hidden is on {q_hidden.device} but hidden is on {hidden.device}")
    else:
        if q_ids is None or q_probs is None:
            raise ValueError("the sparse draft distribution needs both q_ids [D, K] and q_probs [D, K]")
        if q_ids.dtype != torch.int64 or q_ids.dim() != 2 or q_ids.shape[0] != D or q_ids.shape[1] < 1:
            raise ValueError(f"q_ids must be an int64 tensor [D, K] = [{D}, K >= 1], got {q_ids.dtype} "
                             f"{tuple(q_ids.shape)}")
        if not q_probs.dtype.is_floating_point or tuple(q_probs.shape) != tuple(q_ids.shape):
            raise ValueError(f"q_probs must be a float tensor shaped like q_ids {tuple(q_ids.shape)}, got "
                             f"{q_probs.dtype} {tuple(q_probs.shape)}")
        for name, t in (("q_ids", q_ids), ("q_probs", q_probs)):
            if t.device != hidden.device:
                raise ValueError(f"{name} is on {t.device} but hidden is on {hidden.device}")
    if check_bounds:
        for name, ids in (("proposals", proposals), ("q_ids", q_ids)):
            if ids is not None and ids.numel() and bool(((ids < 0) | (ids >= V)).any()):
                raise IndexError(f"{name} hold ids outside the vocabulary [0, {V}): min {int(ids.min())}, "
                                 f"max {int(ids.max())}")
    if not isinstance(seed, torch.Tensor):
        raise TypeError(f"rejection_sample: seed must be an int64 tensor [1] on hidden's device (its noise is "
                        f"keyed on the device), got {type(seed).__name__}")
    return check_seed_tensor(seed, hidden.device, "rejection_sample")


def acceptance_uniforms(seed: torch.Tensor, n: int, vocab: int) -> torch.Tensor:
    """fp32 ``[n]`` in ``[0, 1)``: ``u_k = exp(-exp(-G(seed, k, vocab)))``, the acceptance tests' uniforms."""
    device = seed.device
    cols = torch.full((1,), vocab, dtype=torch.long, device=device)  # made on the device: no host copy in a round
    g = gumbel_noise(seed, torch.arange(n, device=device), cols)[:, 0]
    return torch.exp(-torch.exp(-g))


def draft_probs(weight, D: int, temperature: float, top_k, top_p, min_p, q_hidden=None, q_ids=None, q_probs=None,
                logit_dtype=None) -> torch.Tensor:
    """fp32 ``[D, V]``: the draft distribution ``q`` of either form (module docstring)."""
    V = weight.shape[0]
    if q_hidden is not None:
        head = HeadInputs(q_hidden, weight, None, 1e-6, None, None)
        logits = model_logits(head, resolve_logit_dtype(q_hidden, weight, logit_dtype))
        return processed_probs(logits, temperature, top_k, top_p, min_p)
    q = torch.zeros(D, V, dtype=torch.float32, device=weight.device)
    return q.scatter_add_(1, q_ids, q_probs.float())


def rejection_sample(hidden, weight, proposals, temperature, *, q_hidden=None, q_ids=None, q_probs=None, top_k=None,
                     top_p=None, min_p=None, norm_weight=None, eps=1e-6, softcap=None, seed=None, logit_dtype=None,
                     q_logit_dtype=None, check_bounds=True) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(choices [D + 1] int64, accepted [1] int64)`` of the module docstring's rule.

    ``logit_dtype`` / ``q_logit_dtype``: the dtypes the target's / the dense
    draft's logits are rounded to (None: the promotion of the row and weight
    dtypes, as every lm_head op). ``seed``: int64 tensor ``[1]``.
    """
    head: HeadInputs = head_inputs(hidden, weight, norm_weight, eps, None, softcap, check_bounds=False)
    seed = check_rejection_args(hidden, weight, proposals, q_hidden, q_ids, q_probs, seed, check_bounds=check_bounds)
    t = check_temperature(temperature)
    top_k, top_p, min_p = check_sampling_args(top_k, top_p, min_p)
    D = proposals.shape[0]
    logits = model_logits(head, resolve_logit_dtype(hidden, weight, logit_dtype))
    p = torch.softmax(processed_scores(logits, t, top_k, top_p, min_p), dim=-1)  # [D + 1, V]
    q = draft_probs(weight, D, t, top_k, top_p, min_p, q_hidden, q_ids, q_probs, q_logit_dtype)  # [D, V]
    return rejection_from_probs(p, q, proposals, seed)


def rejection_from_probs(p: torch.Tensor, q: torch.Tensor, proposals: torch.Tensor,
                         seed: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """The module docstring's rule on given distributions: ``p [D + 1, V]`` the target's processed
    probabilities at the verify rows, ``q [D, V]`` the draft's, ``proposals [D]``, ``seed`` a 0-d / ``[1]`` int64
    tensor; returns ``(choices [D + 1], accepted [1])`` (how :func:`rejection_sample` ends; also the rule of a
    head whose logits come from elsewhere than a weight)."""
    D, V = proposals.shape[0], p.shape[1]
    device = p.device
    x = proposals[:, None]
    px, qx = p[:D].gather(1, x)[:, 0], q.gather(1, x)[:, 0]
    u = acceptance_uniforms(seed, D, V)
    accepted = torch.cumprod((u * qx < px).long(), 0).sum().reshape(1)
    residual = torch.cat([(p[:D] - q).clamp_min(0.0), torch.zeros_like(p[D:])])
    r = torch.where(residual.sum(1, keepdim=True) > 0, residual, p)
    noise = gumbel_noise(seed, torch.arange(D + 1, device=device), torch.arange(V, device=device))
    y = torch.argmax(torch.log(r) + noise, dim=1)
    k = torch.arange(D + 1, device=device)
    choices = torch.where(k < accepted, torch.cat([proposals, proposals.new_zeros(1)]), y)
    return choices, accepted
