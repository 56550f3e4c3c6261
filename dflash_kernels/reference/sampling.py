"""Reference sampling from transformers' *processed* distribution: temperature, top-k, top-p, min-p.

Shapes: ``hidden [T, H]``, ``weight [V, H]``, ``norm_weight [H]``, ``positions [N]``
(as :mod:`dflash_kernels.reference.lm_head`). Per selected row, with
``x = logits.to(logit_dtype).float()`` (fp32 ``[N, V]``, the model-dtype logits
transformers' ``generate()`` copies to fp32 before its processors) the
processed scores are, in transformers' order (``generation/utils.py`` builds
the warpers as temperature, top-k, top-p, min-p; every filtered score is
``-inf``, ``min_tokens_to_keep = 1``)::

    s = x / T                                        temperature (T > 0)
    top-k (k >= 1):  s[i] = -inf  where s[i] < kth_largest(s)      ties at the k-th value all stay
    top-p (p < 1):   sort s ascending (stable: equal scores by id ascending);
                     c = cumsum(softmax(sorted s)); drop sorted positions with c <= 1 - p,
                     never the last (the largest score)
                     == keep token j iff the mass of the tokens before it in
                        (score desc, id desc) order is < p
    min-p (m given): P = softmax(s); s[i] = -inf where P[i] < m * max(P)   (never the top token)

and the token is one draw from ``softmax(s)`` (``torch.multinomial``; with a
device seed tensor, ``lm_head_sample_processed(..., seed=tensor)``: Gumbel-max
``argmax(s + gumbel_noise(seed, row, id))``, the noise of
:func:`dflash_kernels.reference.gumbel_noise`). These
build the full ``[N, V]`` logits: the spec, not the fast path
(:func:`dflash_kernels.lm_head_sample_processed`).

Ties inside the nucleus boundary: transformers sorts with ``torch.sort`` (not
stable on the CPU, a stable radix sort on CUDA for large rows), so which of
several *equal* scores at the top-p cut survive is unspecified there; here (and
in the fast path) the highest ids survive, i.e. the stable ascending sort.
Every other rule above is deterministic and equals the warpers exactly.

Argument rules (shared with the fast path): ``top_k`` None or an int ``>= 0``
(0 or None: off; ``k >= V``: nothing removed); ``top_p`` None or a float in
``(0, 1]`` (1 or None: off); ``min_p`` None or a float in ``[0, 1]``.
"""

from __future__ import annotations

import math
import numbers
from typing import Optional, Tuple

import torch

from .lm_head import (HeadInputs, check_seed_tensor, check_temperature, gumbel_noise, head_inputs, normed_rows,
                      resolve_logit_dtype, seed_from, soft_cap)

__all__ = [
    "check_sampling_args",
    "processed_scores",
    "processed_probs",
    "lm_head_sample_processed",
]


def check_sampling_args(top_k, top_p, min_p) -> Tuple[Optional[int], Optional[float], Optional[float]]:
    """Validate the warper arguments; returns them normalized (``None`` for a warper that is off).

    ``top_k``: None or an int >= 0 (0 = off, as transformers' ``top_k=0``);
    ``top_p``: None or a real in (0, 1] (1 = off); ``min_p``: None or a real in [0, 1].
    Errors name the argument and the allowed range.
    """
    if top_k is not None:
        if isinstance(top_k, bool) or not isinstance(top_k, numbers.Integral):
            raise TypeError(f"top_k must be None or an int >= 0, got {type(top_k).__name__} {top_k!r}")
        if top_k < 0:
            raise ValueError(f"top_k must be None or an int >= 0 (0 = no top-k filtering), got {top_k}")
        top_k = int(top_k) or None
    if top_p is not None:
        if isinstance(top_p, bool) or not isinstance(top_p, numbers.Real):
            raise TypeError(f"top_p must be None or a float in (0, 1], got {type(top_p).__name__} {top_p!r}")
        if not (0.0 < float(top_p) <= 1.0):
            raise ValueError(f"top_p must be a float in (0, 1] (1 = no nucleus filtering), got {top_p!r}")
        top_p = float(top_p) if float(top_p) < 1.0 else None
    if min_p is not None:
        if isinstance(min_p, bool) or not isinstance(min_p, numbers.Real):
            raise TypeError(f"min_p must be None or a float in [0, 1], got {type(min_p).__name__} {min_p!r}")
        if not (0.0 <= float(min_p) <= 1.0) or math.isnan(float(min_p)):
            raise ValueError(f"min_p must be a float in [0, 1], got {min_p!r}")
        min_p = float(min_p)
    return top_k, top_p, min_p


def processed_scores(logits: torch.Tensor, temperature: float, top_k=None, top_p=None, min_p=None) -> torch.Tensor:
    """fp32 ``[N, V]`` processed scores of ``logits [N, V]`` (any float dtype): ``-inf`` where filtered.

    Temperature, then top-k, top-p, min-p, exactly as the module docstring
    states (arguments as :func:`check_sampling_args` accepts them).
    """
    t = check_temperature(temperature)
    top_k, top_p, min_p = check_sampling_args(top_k, top_p, min_p)
    s = logits.float() / t
    neg_inf = float("-inf")
    V = s.shape[-1]
    if top_k is not None and V > 0:
        kth = torch.topk(s, min(top_k, V), dim=-1).values[..., -1:]
        s = s.masked_fill(s < kth, neg_inf)
    if top_p is not None:
        ascending, order = torch.sort(s, dim=-1, descending=False, stable=True)
        cumulative = ascending.softmax(dim=-1).cumsum(dim=-1)
        drop_sorted = cumulative <= (1 - top_p)
        drop_sorted[..., -1:] = False
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        s = s.masked_fill(drop, neg_inf)
    if min_p is not None:
        probs = torch.softmax(s, dim=-1)
        top = probs.amax(dim=-1, keepdim=True)
        drop = probs < min_p * top
        drop.scatter_(-1, torch.argmax(probs, dim=-1, keepdim=True), False)
        s = s.masked_fill(drop, neg_inf)
    return s


def processed_probs(logits: torch.Tensor, temperature: float, top_k=None, top_p=None, min_p=None) -> torch.Tensor:
    """fp32 ``[N, V]``: ``softmax(processed_scores(...))``, the distribution a sample is drawn from."""
    return torch.softmax(processed_scores(logits, temperature, top_k, top_p, min_p), dim=-1)


def model_logits(head: HeadInputs, logit_dtype) -> torch.Tensor:
    """``[N, V]`` logits in ``logit_dtype`` as the model computes them.

    Normed rows (HF RMSNorm), then ``F.linear`` in the model dtype when
    hidden, weight and ``logit_dtype`` agree and there is no softcap (the GEMM
    transformers runs); otherwise the fp32 product, soft-capped, rounded once.
    """
    a = normed_rows(head)
    w = head.weight.detach()
    if head.softcap is None and a.dtype == w.dtype == logit_dtype:
        return torch.nn.functional.linear(a, w)
    return soft_cap(a.float() @ w.float().T, head.softcap).to(logit_dtype)


def lm_head_sample_processed(hidden, weight, temperature, *, top_k=None, top_p=None, min_p=None, norm_weight=None,
                             eps=1e-6, positions=None, seed=None, generator=None, logit_dtype=None, softcap=None,
                             check_bounds=True) -> torch.Tensor:
    """int64 ``[N]``: one draw per row from ``softmax(processed_scores(logits, T, top_k, top_p, min_p))``.

    ``logits`` as :func:`model_logits` (``logit_dtype`` None: the promotion of
    hidden's and the weight's dtypes; ``softcap`` c: ``c * tanh(x / c)`` on the
    fp32 logits before the rounding). ``seed``: a private generator seeded
    with it; else ``generator`` (else torch's default one). ``seed`` an int64
    tensor ``[1]`` / ``[]``: the Gumbel-max draw keyed by its value
    (:func:`processed_device_seed`).
    """
    if generator is not None and seed is not None:
        raise ValueError("pass either generator or seed to lm_head_sample_processed, not both")
    head = head_inputs(hidden, weight, norm_weight, eps, positions, softcap, check_bounds=check_bounds)
    t = check_temperature(temperature)
    top_k, top_p, min_p = check_sampling_args(top_k, top_p, min_p)
    logit_dtype = resolve_logit_dtype(hidden, weight, logit_dtype)
    if isinstance(seed, torch.Tensor):
        seed = check_seed_tensor(seed, hidden.device, "lm_head_sample_processed")
        return processed_device_seed(head, t, top_k, top_p, min_p, seed, logit_dtype)
    logits = model_logits(head, logit_dtype)
    if logits.shape[0] == 0:
        return torch.empty(0, dtype=torch.int64, device=hidden.device)
    if seed is not None:
        generator = torch.Generator(device=hidden.device)
        generator.manual_seed(seed_from(None, seed) % (2 ** 63))
    probs = processed_probs(logits, t, top_k, top_p, min_p)
    return torch.multinomial(probs, 1, generator=generator).squeeze(1)


def processed_device_seed(head: HeadInputs, t: float, top_k, top_p, min_p, seed: torch.Tensor,
                          logit_dtype: torch.dtype) -> torch.Tensor:
    """int64 ``[N]``: :func:`lm_head_sample_processed` with the seed an int64 tensor ``[1]`` / ``[]``.

    ``token[n] = argmax_j(s[n, j] + gumbel_noise(seed, n, j))`` with ``s =
    processed_scores(logits, t, top_k, top_p, min_p)`` (``-inf`` where filtered),
    the lowest id on ties: an exact draw from ``softmax(s)``. A pure function
    of the seed's value; no generator, no host read (with ``check_bounds=False``
    at the public op), fixed shapes: ``torch.compile(fullgraph=True)`` traces it.
    """
    hidden = head.hidden
    logits = model_logits(head, logit_dtype)
    n, vocab = logits.shape
    s = processed_scores(logits, t, top_k, top_p, min_p)
    noise = gumbel_noise(seed, torch.arange(n, device=hidden.device), torch.arange(vocab, device=hidden.device))
    return torch.argmax(s + noise, dim=-1)
