"""Reference final RMSNorm + lm_head at selected positions, and its consumers.

Shapes: ``hidden [T, H]`` (fp32 / bf16 / fp16), ``weight [V, H]`` (the
lm_head, bf16 / fp16 / fp32), ``norm_weight [H]`` (optional final RMSNorm),
``positions [N]`` int64 rows of ``hidden`` (None: all T rows, N = T).

Math, exactly as Hugging Face's ``Qwen3RMSNorm`` / ``LlamaRMSNorm`` then
``lm_head``::

    x        = hidden[positions]                                   [N, H]
    x_normed = x.float() * rsqrt(mean(x.float()^2, -1) + eps)       fp32
    a        = (norm_weight * x_normed.to(x.dtype)).to(x.dtype)     [N, H]  (a = x without norm)
    logits   = a.float() @ weight.float().T                        fp32 [N, V]

optionally soft-capped (``softcap = c``, Gemma 2 / 3's final-logit softcap)
on the fp32 logits, before anything else touches them::

    logits   = c * tanh(logits / c)                                 fp32 [N, V]

and the consumers of ``logits``:

* ``lm_head_logits``: ``logits`` (fp32 by default, or ``logits.to(logit_dtype)``).
* ``lm_head_argmax``: ``argmax(logits.to(logit_dtype), -1)`` (ties: lowest
  index). ``logit_dtype`` None (default) is the dtype ``F.linear(a, weight)``
  returns, ``promote_types(hidden.dtype, weight.dtype)``: bf16 for a bf16
  model, which is what transformers' ``generate()`` takes the argmax of
  (``.to`` rounds to nearest even, as a bf16 GEMM rounds its fp32
  accumulator); ``torch.float32`` compares the fp32 logits themselves.
* ``lm_head_topk``: top-k of ``log_softmax(logits, -1)``, best first.
* ``lm_head_sample``: one draw per row from
  ``softmax(logits.to(logit_dtype).float() / temperature)``.
* ``lm_head_cross_entropy``: ``weights * (logsumexp(logits) - logits[target])``
  per row (0 where ``target == ignore_index``), differentiable wrt ``hidden``
  only (``weight``, ``norm_weight`` and ``weights`` are constants).

These materialize the full ``[N, V]`` logits: they are the spec, not the fast
path. The argument checks are shared with the Triton launchers
(:func:`check_lm_head_args` and friends), so both paths accept the same inputs
and fail with the same messages.
"""

from __future__ import annotations

import math
import numbers
from typing import Optional, Tuple

import torch
import torch.nn.functional as F

from .gather import check_rows

__all__ = [
    "rms_norm",
    "lm_head_logits",
    "lm_head_argmax",
    "lm_head_topk",
    "lm_head_sample",
    "lm_head_cross_entropy",
]

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


# --------------------------------------------------------------------------- checks


def check_lm_head_args(hidden, weight, norm_weight, eps, positions, *, check_bounds: bool = True):
    """Validate the common arguments; returns ``positions`` as int64 on the device (or None)."""
    if not isinstance(hidden, torch.Tensor):
        raise TypeError(f"hidden must be a torch.Tensor [T, H], got {type(hidden).__name__}")
    if not isinstance(weight, torch.Tensor):
        raise TypeError(f"weight must be a torch.Tensor [V, H], got {type(weight).__name__}")
    if hidden.dim() != 2:
        raise ValueError(f"hidden must be 2-D [T, H] (flatten batch dims first), got shape {tuple(hidden.shape)}")
    if weight.dim() != 2:
        raise ValueError(f"weight must be 2-D [V, H] (the lm_head weight), got shape {tuple(weight.shape)}")
    if hidden.dtype not in FLOAT_DTYPES:
        raise TypeError(f"hidden has dtype {hidden.dtype}; allowed: float32, bfloat16, float16")
    if weight.dtype not in FLOAT_DTYPES:
        raise TypeError(f"weight has dtype {weight.dtype}; allowed: float32, bfloat16, float16")
    T, H = hidden.shape
    V, HW = weight.shape
    if H == 0:
        raise ValueError("hidden has hidden size 0")
    if V == 0:
        raise ValueError("weight has 0 rows (empty vocabulary)")
    if HW != H:
        raise ValueError(f"weight is [V, H] = {list(weight.shape)} but hidden has H = {H}; the hidden sizes must match")
    if weight.device != hidden.device:
        raise ValueError(f"weight is on {weight.device} but hidden is on {hidden.device}")
    if norm_weight is not None:
        if not isinstance(norm_weight, torch.Tensor):
            raise TypeError(f"norm_weight must be a torch.Tensor [H] or None, got {type(norm_weight).__name__}")
        if tuple(norm_weight.shape) != (H,):
            raise ValueError(f"norm_weight must have shape [H] = [{H}], got {tuple(norm_weight.shape)}")
        if norm_weight.dtype not in FLOAT_DTYPES:
            raise TypeError(f"norm_weight has dtype {norm_weight.dtype}; allowed: float32, bfloat16, float16")
        if norm_weight.device != hidden.device:
            raise ValueError(f"norm_weight is on {norm_weight.device} but hidden is on {hidden.device}")
    if not isinstance(eps, (int, float)) or not math.isfinite(eps) or eps < 0:
        raise ValueError(f"eps must be a finite float >= 0, got {eps!r}")
    return check_rows(positions, T, hidden.device, what="positions", check_bounds=check_bounds)


def resolve_logit_dtype(hidden: torch.Tensor, weight: torch.Tensor, logit_dtype) -> torch.dtype:
    """The dtype the logits are rounded to: ``logit_dtype``, or for None the dtype ``F.linear`` returns.

    ``F.linear(rms_norm(hidden), weight)`` computes in the promotion of
    hidden's dtype (the norm keeps it) and the weight's.
    """
    if logit_dtype is None:
        return torch.promote_types(hidden.dtype, weight.dtype)
    if not isinstance(logit_dtype, torch.dtype) or logit_dtype not in FLOAT_DTYPES:
        raise TypeError(f"logit_dtype must be None, torch.float32, torch.bfloat16 or torch.float16; "
                        f"got {logit_dtype!r}")
    return logit_dtype


def check_softcap(softcap) -> Optional[float]:
    """``softcap`` as a float (None stays None): a finite real ``> 0``, else a ValueError naming it."""
    if softcap is None:
        return None
    if isinstance(softcap, bool) or not isinstance(softcap, numbers.Real) or not math.isfinite(softcap) \
            or softcap <= 0:
        raise ValueError(f"softcap must be None or a finite float > 0 (the final-logit softcap), got {softcap!r}")
    return float(softcap)


def check_k(k, vocab: int) -> int:
    if isinstance(k, bool) or not isinstance(k, int):
        raise TypeError(f"k must be an int, got {type(k).__name__}")
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    if k > vocab:
        raise ValueError(f"k = {k} exceeds the vocabulary size V = {vocab}")
    return k


def check_temperature(temperature) -> float:
    if isinstance(temperature, torch.Tensor):
        if temperature.numel() != 1:
            raise ValueError(f"temperature must be a scalar, got a tensor of shape {tuple(temperature.shape)}")
        temperature = float(temperature.item())
    try:
        t = float(temperature)
    except (TypeError, ValueError) as exc:
        raise TypeError(f"temperature must be a float, got {type(temperature).__name__}") from exc
    if not (t > 0) or not math.isfinite(t):
        raise ValueError(f"temperature must be a finite float > 0, got {temperature!r}; "
                         "for greedy decoding (temperature 0) use lm_head_argmax")
    return t


def check_targets(targets, weights, n: int, vocab: int, device: torch.device, ignore_index: int):
    """Validate CE targets [N] (ints in [0, V) or ignore_index) and weights [N]; returns (targets int64, weights)."""
    if not isinstance(targets, torch.Tensor):
        raise TypeError(f"targets must be an integer tensor [N], got {type(targets).__name__}")
    if targets.dtype.is_floating_point or targets.dtype.is_complex or targets.dtype == torch.bool:
        raise TypeError(f"targets must hold integer token ids, got dtype {targets.dtype}")
    if tuple(targets.shape) != (n,):
        raise ValueError(f"targets must have shape [N] = [{n}] (one per selected position), got {tuple(targets.shape)}")
    if targets.device != device:
        raise ValueError(f"targets is on {targets.device} but hidden is on {device}")
    targets = targets.to(torch.int64)
    if n > 0:
        bad = ((targets < 0) | (targets >= vocab)) & (targets != ignore_index)
        if bool(bad.any()):
            where = int(bad.nonzero()[0, 0])
            raise IndexError(f"targets[{where}] = {int(targets[where])} is out of range: token ids are 0..{vocab - 1} "
                             f"(or ignore_index = {ignore_index})")
    if weights is not None:
        if not isinstance(weights, torch.Tensor):
            raise TypeError(f"weights must be a float tensor [N] or None, got {type(weights).__name__}")
        if not weights.dtype.is_floating_point:
            raise TypeError(f"weights must be a float tensor, got dtype {weights.dtype}")
        if tuple(weights.shape) != (n,):
            raise ValueError(f"weights must have shape [N] = [{n}], got {tuple(weights.shape)}")
        if weights.device != device:
            raise ValueError(f"weights is on {weights.device} but hidden is on {device}")
    return targets, weights


def seed_from(generator: Optional[torch.Generator], seed: Optional[int]) -> int:
    """One 62-bit seed: ``seed`` itself, else a draw from ``generator`` (else torch's default generator)."""
    if generator is not None and seed is not None:
        raise ValueError("pass either generator or seed to lm_head_sample, not both")
    if seed is not None:
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise TypeError(f"seed must be an int, got {type(seed).__name__}")
        return seed
    device = generator.device if generator is not None else "cpu"
    return int(torch.randint(0, 2 ** 62, (), generator=generator, device=device).item())


# --------------------------------------------------------------------------- math


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """HF RMSNorm: ``(weight * (x * rsqrt(mean(x^2) + eps)).to(x.dtype)).to(x.dtype)``, stats in fp32."""
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (weight * normed.to(x.dtype)).to(x.dtype)


def _normed_rows(hidden, norm_weight, eps, positions) -> torch.Tensor:
    rows = hidden if positions is None else hidden.index_select(0, positions)
    if norm_weight is None:
        return rows
    return rms_norm(rows, norm_weight.detach(), eps)


def soft_cap(logits: torch.Tensor, softcap: Optional[float]) -> torch.Tensor:
    """``softcap * tanh(logits / softcap)`` (None: ``logits`` unchanged); differentiable."""
    if softcap is None:
        return logits
    return softcap * torch.tanh(logits / softcap)


def _logits(hidden, weight, norm_weight, eps, positions, softcap=None) -> torch.Tensor:
    a = _normed_rows(hidden, norm_weight, eps, positions)
    return soft_cap(a.float() @ weight.detach().float().T, softcap)


def _rounded_logits(hidden, weight, norm_weight, eps, positions, logit_dtype, softcap=None) -> torch.Tensor:
    """Logits in ``logit_dtype``: for the model dtype, the GEMM transformers runs (``F.linear`` in that
    dtype, whose fp32 accumulator the library rounds once), so ties break exactly as in ``generate()``.
    With ``softcap`` the fp32 logits are capped, then rounded once."""
    a = _normed_rows(hidden, norm_weight, eps, positions)
    w = weight.detach()
    if softcap is None and logit_dtype != torch.float32 and a.dtype == w.dtype == logit_dtype:
        return torch.nn.functional.linear(a, w)
    return soft_cap(a.float() @ w.float().T, softcap).to(logit_dtype)


def lm_head_logits(hidden, weight, *, norm_weight=None, eps=1e-6, positions=None, check_bounds=True,
                   logit_dtype=torch.float32, softcap=None):
    """``[N, V]`` logits of the (normed) rows at ``positions``, soft-capped with ``softcap``: fp32, or
    rounded to ``logit_dtype``."""
    positions = check_lm_head_args(hidden, weight, norm_weight, eps, positions, check_bounds=check_bounds)
    logit_dtype = resolve_logit_dtype(hidden, weight, logit_dtype)
    softcap = check_softcap(softcap)
    return _logits(hidden, weight, norm_weight, eps, positions, softcap).to(logit_dtype)


def lm_head_argmax(hidden, weight, *, norm_weight=None, eps=1e-6, positions=None, check_bounds=True,
                   logit_dtype=None, softcap=None):
    """int64 ``[N]``: ``argmax`` of the (capped) logits rounded to ``logit_dtype`` (lowest index on ties)."""
    positions = check_lm_head_args(hidden, weight, norm_weight, eps, positions, check_bounds=check_bounds)
    logit_dtype = resolve_logit_dtype(hidden, weight, logit_dtype)
    softcap = check_softcap(softcap)
    return torch.argmax(_rounded_logits(hidden, weight, norm_weight, eps, positions, logit_dtype, softcap), dim=-1)


def lm_head_topk(hidden, weight, k, *, norm_weight=None, eps=1e-6, positions=None,
                 check_bounds=True, softcap=None) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(logprobs fp32 [N, k], ids int64 [N, k])``: top-k of the full-vocab log-softmax of the (capped)
    logits, best first."""
    positions = check_lm_head_args(hidden, weight, norm_weight, eps, positions, check_bounds=check_bounds)
    check_k(k, weight.shape[0])
    softcap = check_softcap(softcap)
    logprobs = torch.log_softmax(_logits(hidden, weight, norm_weight, eps, positions, softcap), dim=-1)
    values, ids = torch.topk(logprobs, k, dim=-1, largest=True, sorted=True)
    return values, ids


def lm_head_sample(hidden, weight, temperature, *, norm_weight=None, eps=1e-6, positions=None, generator=None,
                   seed=None, check_bounds=True, logit_dtype=None, softcap=None) -> torch.Tensor:
    """int64 ``[N]``: one draw per row from ``softmax(logits.to(logit_dtype).float() / temperature)``
    (``logits`` soft-capped first with ``softcap``).

    Reproducible: with ``seed`` a private generator seeded with it is used;
    otherwise ``generator`` (or torch's default generator).
    """
    positions = check_lm_head_args(hidden, weight, norm_weight, eps, positions, check_bounds=check_bounds)
    t = check_temperature(temperature)
    logit_dtype = resolve_logit_dtype(hidden, weight, logit_dtype)
    softcap = check_softcap(softcap)
    if generator is not None and seed is not None:
        raise ValueError("pass either generator or seed to lm_head_sample, not both")
    logits = _rounded_logits(hidden, weight, norm_weight, eps, positions, logit_dtype, softcap).float()
    if logits.shape[0] == 0:
        return torch.empty(0, dtype=torch.int64, device=hidden.device)
    if seed is not None:
        generator = torch.Generator(device=hidden.device)
        generator.manual_seed(seed_from(None, seed) % (2 ** 63))
    probs = torch.softmax(logits / t, dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(1)


def lm_head_cross_entropy(hidden, weight, targets, *, weights=None, norm_weight=None, eps=1e-6, positions=None,
                          ignore_index=-100, check_bounds=True, softcap=None) -> torch.Tensor:
    """fp32 ``[N]`` per-row losses ``weights * (logsumexp(logits) - logits[target])``; 0 at ``ignore_index``.

    Differentiable wrt ``hidden`` only (``weight``, ``norm_weight`` and the loss
    ``weights`` are detached); with ``softcap`` the logits are capped first
    and autograd goes through the tanh.
    """
    positions = check_lm_head_args(hidden, weight, norm_weight, eps, positions, check_bounds=check_bounds)
    softcap = check_softcap(softcap)
    n = hidden.shape[0] if positions is None else positions.numel()
    targets, weights = check_targets(targets, weights, n, weight.shape[0], hidden.device, ignore_index)
    logits = _logits(hidden, weight, norm_weight, eps, positions, softcap)
    loss = F.cross_entropy(logits, targets, reduction="none", ignore_index=ignore_index)
    if weights is not None:
        loss = loss * weights.detach().float()
    return loss
