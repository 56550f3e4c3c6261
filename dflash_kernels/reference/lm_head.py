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
(The training loss over the same logits: :mod:`dflash_kernels.reference.cross_entropy`.)

Device seed (``lm_head_sample(..., seed=)`` with ``seed`` an int64 tensor ``[1]`` / ``[]``):
the draw is Gumbel-max, ``argmax(logits.to(logit_dtype).float() * (1 / T) + G)``
(``1 / T`` rounded to fp32 once, as the kernel multiplies), with the noise
``G[n, j] = gumbel_noise(seed, n, j)`` a pure function of the seed's VALUE,
the output row ``n`` and the vocab id ``j`` (:func:`philox_uint32`, a
counter-based hash in int64 tensor ops): no generator, no host read, so a
captured graph replays new noise when the caller changes the seed tensor.

These materialize the full ``[N, V]`` logits: they are the spec, not the fast
path. The argument checks are shared with the Triton launchers
(:func:`check_lm_head_args` and friends), so both paths accept the same inputs
and fail with the same messages. The six inputs that define the logits travel
between the internal functions as one :class:`HeadInputs`.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Optional, Tuple

import torch

from ..noise import (check_seed_tensor, gumbel_noise, philox_uint32, philox_words,  # noqa: F401
                     uniform_noise)
from .gather import check_rows

__all__ = [
    "rms_norm",
    "lm_head_logits",
    "lm_head_argmax",
    "lm_head_topk",
    "lm_head_sample",
    "HeadInputs",
    "philox_uint32",
    "philox_words",
    "uniform_noise",
    "gumbel_noise",
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


@dataclasses.dataclass(frozen=True)
class HeadInputs:
    """What defines the logits of an lm_head call, validated:
    ``logits = cap(rms_norm(hidden[positions]; norm_weight, eps) @ weight.T)``.

    ``hidden [T, H]``, ``weight [V, H]``, ``norm_weight [H]`` or None (no final
    norm), ``eps`` (the norm's), ``positions [N]`` int64 on hidden's device or
    None (every row, ``N = T``), ``softcap`` None or ``c > 0`` (``cap(z) = c *
    tanh(z / c)``). Made by :func:`head_inputs`; the public ops keep their
    keyword arguments and hand this to their backends.
    """

    hidden: torch.Tensor
    weight: torch.Tensor
    norm_weight: Optional[torch.Tensor]
    eps: float
    positions: Optional[torch.Tensor]
    softcap: Optional[float]

    @property
    def rows(self) -> int:
        """``N``: the selected rows (``positions``' length, else every row of ``hidden``)."""
        return self.hidden.shape[0] if self.positions is None else self.positions.shape[0]

    @property
    def vocab(self) -> int:
        return self.weight.shape[0]

    def detached(self) -> "HeadInputs":
        """The same inputs with ``hidden`` and ``weight`` cut from autograd (the non-differentiable ops)."""
        return dataclasses.replace(self, hidden=self.hidden.detach(), weight=self.weight.detach())

    def row_chunk(self, r0: int, r1: int) -> "HeadInputs":
        """Selected rows ``r0:r1`` (of the ``N``)."""
        if self.positions is None:
            return dataclasses.replace(self, hidden=self.hidden[r0:r1])
        return dataclasses.replace(self, positions=self.positions[r0:r1])

    def vocab_chunk(self, v0: int, v1: int) -> "HeadInputs":
        """Vocabulary ids ``v0:v1`` (rows of ``weight``)."""
        return dataclasses.replace(self, weight=self.weight[v0:v1])


def head_inputs(hidden, weight, norm_weight, eps, positions, softcap, *, check_bounds: bool = True) -> HeadInputs:
    """:class:`HeadInputs` of a call, after :func:`check_lm_head_args` and :func:`check_softcap`."""
    positions = check_lm_head_args(hidden, weight, norm_weight, eps, positions, check_bounds=check_bounds)
    return HeadInputs(hidden, weight, norm_weight, eps, positions, check_softcap(softcap))


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
    """HF RMSNorm: ``(weight * (x * rsqrt(mean(x^2) + eps)).to(x.dtype)).to(x.dtype)``, stats in fp32.

    On the CPU through ``torch.rms_norm``, one dispatched op where the formula's own are six: its composite
    computes the formula's ops in the formula's order, so the result is the HF module's bit for bit
    (tests/ops/test_lm_head.py holds it in fp32, bf16 and fp16). The weight multiplies after the cast back, as
    HF's does, except in fp32 where the cast is the identity and the weight goes into the one call.
    Elsewhere the formula's own ops: a GPU's fused ``rms_norm`` kernel reduces in another order, which would
    no longer be the modules' bits.
    """
    if x.device.type == "cpu":
        size = x.shape[-1:]
        if x.dtype == torch.float32 and weight.dtype == torch.float32:
            return torch.rms_norm(x, size, weight, eps)
        return (weight * torch.rms_norm(x.float(), size, None, eps).to(x.dtype)).to(x.dtype)
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (weight * normed.to(x.dtype)).to(x.dtype)


def normed_rows(head: HeadInputs) -> torch.Tensor:
    """``a [N, H]``: the selected rows of ``hidden`` through the final norm (differentiable wrt ``hidden``)."""
    rows = head.hidden if head.positions is None else head.hidden.index_select(0, head.positions)
    if head.norm_weight is None:
        return rows
    return rms_norm(rows, head.norm_weight.detach(), head.eps)


def soft_cap(logits: torch.Tensor, softcap: Optional[float]) -> torch.Tensor:
    """``softcap * tanh(logits / softcap)`` (None: ``logits`` unchanged); differentiable."""
    if softcap is None:
        return logits
    return softcap * torch.tanh(logits / softcap)


def _logits(head: HeadInputs) -> torch.Tensor:
    """fp32 ``[N, V]`` capped logits."""
    return soft_cap(normed_rows(head).float() @ head.weight.detach().float().T, head.softcap)


def _rounded_logits(head: HeadInputs, logit_dtype) -> torch.Tensor:
    """Logits in ``logit_dtype``: for the model dtype, the GEMM transformers runs (``F.linear`` in that
    dtype, whose fp32 accumulator the library rounds once), so ties break exactly as in ``generate()``.
    With ``softcap`` the fp32 logits are capped, then rounded once."""
    a = normed_rows(head)
    w = head.weight.detach()
    if head.softcap is None and logit_dtype != torch.float32 and a.dtype == w.dtype == logit_dtype:
        return torch.nn.functional.linear(a, w)
    return soft_cap(a.float() @ w.float().T, head.softcap).to(logit_dtype)


def lm_head_logits(hidden, weight, *, norm_weight=None, eps=1e-6, positions=None, check_bounds=True,
                   logit_dtype=torch.float32, softcap=None):
    """``[N, V]`` logits of the (normed) rows at ``positions``, soft-capped with ``softcap``: fp32, or
    rounded to ``logit_dtype``."""
    head = head_inputs(hidden, weight, norm_weight, eps, positions, softcap, check_bounds=check_bounds)
    return _logits(head).to(resolve_logit_dtype(hidden, weight, logit_dtype))


def lm_head_argmax(hidden, weight, *, norm_weight=None, eps=1e-6, positions=None, check_bounds=True,
                   logit_dtype=None, softcap=None):
    """int64 ``[N]``: ``argmax`` of the (capped) logits rounded to ``logit_dtype`` (lowest index on ties)."""
    head = head_inputs(hidden, weight, norm_weight, eps, positions, softcap, check_bounds=check_bounds)
    return torch.argmax(_rounded_logits(head, resolve_logit_dtype(hidden, weight, logit_dtype)), dim=-1)


def lm_head_topk(hidden, weight, k, *, norm_weight=None, eps=1e-6, positions=None,
                 check_bounds=True, softcap=None) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(logprobs fp32 [N, k], ids int64 [N, k])``: top-k of the full-vocab log-softmax of the (capped)
    logits, best first."""
    head = head_inputs(hidden, weight, norm_weight, eps, positions, softcap, check_bounds=check_bounds)
    check_k(k, weight.shape[0])
    logprobs = torch.log_softmax(_logits(head), dim=-1)
    values, ids = torch.topk(logprobs, k, dim=-1, largest=True, sorted=True)
    return values, ids


def lm_head_sample(hidden, weight, temperature, *, norm_weight=None, eps=1e-6, positions=None, generator=None,
                   seed=None, check_bounds=True, logit_dtype=None, softcap=None) -> torch.Tensor:
    """int64 ``[N]``: one draw per row from ``softmax(logits.to(logit_dtype).float() / temperature)``
    (``logits`` soft-capped first with ``softcap``).

    Reproducible: with ``seed`` an int a private generator seeded with it is
    used; otherwise ``generator`` (or torch's default generator). ``seed`` an
    int64 tensor ``[1]`` / ``[]`` on hidden's device: the Gumbel-max draw keyed
    by its value (:func:`sample_device_seed`; nothing read on the host).
    """
    if generator is not None and seed is not None:
        raise ValueError("pass either generator or seed to lm_head_sample, not both")
    head = head_inputs(hidden, weight, norm_weight, eps, positions, softcap, check_bounds=check_bounds)
    t = check_temperature(temperature)
    logit_dtype = resolve_logit_dtype(hidden, weight, logit_dtype)
    if isinstance(seed, torch.Tensor):
        return sample_device_seed(head, t, check_seed_tensor(seed, hidden.device), logit_dtype)
    logits = _rounded_logits(head, logit_dtype).float()
    if logits.shape[0] == 0:
        return torch.empty(0, dtype=torch.int64, device=hidden.device)
    if seed is not None:
        generator = torch.Generator(device=hidden.device)
        generator.manual_seed(seed_from(None, seed) % (2 ** 63))
    probs = torch.softmax(logits / t, dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(1)


def sample_device_seed(head: HeadInputs, t: float, seed: torch.Tensor, logit_dtype: torch.dtype) -> torch.Tensor:
    """int64 ``[N]``: one draw per row from ``softmax(logits.to(logit_dtype).float() / t)``, the seed a tensor.

    ``token[n] = argmax_j(x[n, j] * inv_t + gumbel_noise(seed, n, j))`` with
    ``x`` the (capped, rounded) logits, ``inv_t`` = fp32 ``1 / t``, the lowest
    id on ties. ``seed``: int64 tensor ``[1]`` / ``[]`` on hidden's device:
    equal values give equal draws, and nothing is read on the host (with
    ``check_bounds=False`` at the public op), so ``torch.compile(fullgraph=True)``
    traces it.
    """
    device = head.hidden.device
    logits = _rounded_logits(head, logit_dtype).float()
    n, vocab = logits.shape
    noise = gumbel_noise(seed, torch.arange(n, device=device), torch.arange(vocab, device=device))
    # 1 / T rounded to fp32 once, as the kernel's fp32 argument (a 0-d tensor: no Python float of a tensor)
    inv_t = torch.full((), 1.0 / t, dtype=torch.float32, device=device)
    return torch.argmax(logits * inv_t + noise, dim=-1)
