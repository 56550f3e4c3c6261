"""Whether a target's final norm is the RMSNorm the fused lm_head ops compute, decided by what it computes.

The lm_head ops (:mod:`dflash_kernels.lm_head`) can fuse one final norm into
the head, the Llama-style RMSNorm of ``dflash_kernels.reference.rms_norm``::

    norm(x) = (w * (x * rsqrt(mean(x^2) + eps)).to(x.dtype)).to(x.dtype)     (statistics in fp32)

Families spell their final norm many ways: ``w`` or ``1 + w`` (Gemma, the
hybrids), the weight applied before or after the cast back to the input dtype
(gpt-oss), a LayerNorm with or without a bias or with ``1 + w`` (StableLM,
Nemotron's ``LayerNorm1P``, Cohere), no weight at all (OLMo), torch's own
``nn.RMSNorm`` (statistics in the input dtype). A class name says none of this
reliably, so :func:`fusable_norm` runs the module itself on probe rows (the
weight's dtype and device: unit, tiny, large and off-centre rows) and fuses
only when its output equals the formula above bit for bit. Any other norm runs
as the module at the rows whose token is needed
(:meth:`~dflash.target.adapter.TargetAdapter.head_inputs`): never an assumed
RMSNorm.
"""

from __future__ import annotations

import weakref
from typing import Optional

import torch

from dflash_kernels.reference import rms_norm

__all__ = ["fusable_norm", "norm_eps"]


def norm_eps(norm) -> Optional[float]:
    """The module's epsilon (``variance_epsilon`` as in transformers' RMSNorms, else ``eps``), or None."""
    for name in ("variance_epsilon", "eps"):
        value = getattr(norm, name, None)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    return None


def _probe_rows(hidden: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``[8, hidden]`` rows spanning the scales a residual stream holds, some far from zero mean."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(8, hidden, generator=g)
    scale = torch.tensor([1.0, 1e-3, 30.0, 1e3, 1.0, 0.1, 5.0, 1.0])[:, None]
    shift = torch.tensor([0.0, 0.0, 0.0, 0.0, 3.0, -0.5, 0.0, 100.0])[:, None]
    return (x * scale + shift).to(dtype=dtype, device=device)


#: module -> (what the answer depends on, the answer): :func:`fusable_norm` probes a module once per weight
_ANSWERS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def fusable_norm(norm) -> Optional[float]:
    """``eps`` when ``norm`` computes exactly the fused ops' RMSNorm with its own ``weight [H]`` (see the module
    docstring), else None (the norm runs as its module). Remembered per module while its class, an instance
    ``forward`` of its own, its weight (the tensor itself, its dtype and device), epsilon and bias stay the same."""
    weight = getattr(norm, "weight", None)
    key = (type(norm), id(vars(norm).get("forward")), id(weight), getattr(weight, "dtype", None),
           getattr(weight, "device", None), norm_eps(norm), getattr(norm, "bias", None) is None)
    try:
        known = _ANSWERS.get(norm)
    except TypeError:  # not weak-referenceable: no memory
        return _probe(norm, weight)
    if known is not None and known[0] == key:
        return known[1]
    eps = _probe(norm, weight)
    _ANSWERS[norm] = (key, eps)
    return eps


def _probe(norm, weight) -> Optional[float]:
    eps = norm_eps(norm)
    if eps is None or type(weight) not in (torch.Tensor, torch.nn.Parameter) or weight.dim() != 1:
        return None
    if not weight.dtype.is_floating_point or weight.device.type == "meta":
        return None
    if getattr(norm, "bias", None) is not None:
        return None
    x = _probe_rows(weight.shape[0], weight.dtype, weight.device)
    with torch.no_grad():
        try:
            got = norm(x)
        except Exception:  # noqa: BLE001 -- a module that cannot take plain rows is not the fusable norm
            return None
        want = rms_norm(x, weight.detach(), eps)
    if not isinstance(got, torch.Tensor) or got.shape != want.shape or got.dtype != want.dtype:
        return None
    return eps if torch.equal(got, want) else None
