"""Quantized targets: which quantizations keep a verify lossless, and the refusal of those that cannot.

A verify runs ``B`` rows (a chain, a tree) through every linear layer at once, where the target's own
``generate()`` decodes one row per forward. That is lossless only if each output row of a layer is a function
of its own input row: then the verify's row ``i`` is the row ``generate()`` computes after the same tokens.
The weights do not matter for that (they are the same in both), the inputs' quantization does:

* **weight-only** quantization (torchao ``Int8WeightOnlyConfig``, ``Float8WeightOnlyConfig``, int4 weight-only;
  bitsandbytes 4-bit, ``Linear4bit``): the input rows are not quantized. Row-independent.
* **dynamic activation** quantization with **per-row (per-token)** scales (torchao
  ``Int8DynamicActivationInt8WeightConfig()`` and ``Float8DynamicActivationFloat8WeightConfig`` with their
  default ``PerRow()`` granularity: ``Int8Tensor.act_quant_kwargs.granularity``; a ``PerRow`` block of an
  activation ``[b, T, H]`` is ``(1, 1, H)``, one scale per token; ``PerToken`` and ``PerGroup`` likewise):
  each row is quantized with its own scale, then an integer GEMM, which is exact. Row-independent.
* **static** activation scales (torchao ``act_quant_scale`` set): fixed numbers. Row-independent.
* dynamic activation quantization with **one scale for the whole input** (``PerTensor()``): the scale is the
  absolute maximum over every row of the pass, so a verify row is quantized differently when the other rows
  change it, and a chain verify of ``B`` rows differs from decoding them one at a time. **Refused.**
* bitsandbytes **LLM.int8** (``Linear8bitLt``) with ``llm_int8_threshold > 0`` (its default, 6.0): the
  "outlier" input columns (any entry ``>= threshold``) are taken out of the int8 product and computed in
  16 bit, for **every** row of the pass, so one row's outlier changes how the other rows are computed (and a
  single row skips that step). **Refused**; ``llm_int8_threshold=0.0`` (plain per-row int8) is row-independent.

:func:`check_row_independent` walks the model's modules once when an adapter opens and raises
:class:`~dflash.target.families.UnsupportedTargetFeature` naming the first module that breaks the rule and
why. Nothing here imports torchao or bitsandbytes: their objects are recognised by their attributes and the
classes already in ``sys.modules``.
"""

from __future__ import annotations

import sys
from typing import Optional

from .families import UnsupportedTargetFeature

__all__ = ["check_row_independent", "quantizes_activations", "row_dependence"]

#: torchao activation granularities that give each token its own scale (the class names in
#: ``torchao.quantization.granularity``)
PER_ROW_GRANULARITIES = ("PerRow", "PerToken", "PerGroup")


def _torchao_reason(weight) -> Optional[str]:
    """Why a torchao quantized weight's layer mixes its input rows (None: it does not)."""
    kwargs = getattr(weight, "act_quant_kwargs", None)
    if kwargs is None:
        return None  # weight-only
    if getattr(weight, "act_quant_scale", None) is not None:
        return None  # static activation scales
    granularity = getattr(kwargs, "granularity", None)
    name = type(granularity).__name__
    if name in PER_ROW_GRANULARITIES:
        return None
    span = ("one scale over every row of a pass" if name == "PerTensor" else
            "scales not known to be one per token")
    return (f"torchao {type(weight).__name__} quantizes its input activations dynamically with {name} scales, "
            f"{span}: a speculative verify's rows would change each other's quantization, so it cannot equal "
            "decoding them one at a time (quantize with PerRow() activation granularity, one scale per token, or "
            "weight-only)")


def _bitsandbytes_reason(module) -> Optional[str]:
    """Why a bitsandbytes layer mixes its input rows (None: it does not)."""
    bnb = sys.modules.get("bitsandbytes.nn")
    linear8 = getattr(bnb, "Linear8bitLt", None)
    if linear8 is None or not isinstance(module, linear8):
        return None
    threshold = float(getattr(getattr(module, "state", None), "threshold", 0.0) or 0.0)
    if threshold <= 0.0:
        return None
    return (f"bitsandbytes LLM.int8 outlier decomposition (llm_int8_threshold={threshold}): the input columns "
            "holding an outlier in any row of a pass are computed in 16 bit for every row, so a speculative "
            "verify's rows change each other's results and cannot equal decoding them one at a time (load with "
            "BitsAndBytesConfig(load_in_8bit=True, llm_int8_threshold=0.0), or 4-bit)")


def row_dependence(module) -> Optional[str]:
    """Why ``module``'s output rows depend on the other rows of its input (None: each row is its own);
    ``module``'s own parameters only, not its children's."""
    reason = _bitsandbytes_reason(module)
    if reason is not None:
        return reason
    weight = module._parameters.get("weight") if hasattr(module, "_parameters") else None
    return None if weight is None else _torchao_reason(weight)


def check_row_independent(model, modules=None) -> None:
    """Raise :class:`UnsupportedTargetFeature` naming the first module of ``model`` whose quantization makes a
    verify row depend on the other rows (module docstring); quiet for every other target. ``modules``:
    ``model.modules()`` when the caller already listed them."""
    for module in (model.modules() if modules is None else modules):
        reason = row_dependence(module)
        if reason is not None:
            name = next(n for n, m in model.named_modules() if m is module)
            raise UnsupportedTargetFeature(type(model).__name__, f"row-dependent quantization in {name}", reason)


def quantizes_activations(model, modules=None) -> bool:
    """Whether a module of ``model`` quantizes its input activations at run time (torchao dynamic activation
    quantization, bitsandbytes LLM.int8): a last-bit difference in an input row can move it to another
    quantization step, so such a target runs the attention that gives the model's own numbers bit for bit.
    ``modules``: ``model.modules()`` when the caller already listed them."""
    bnb = sys.modules.get("bitsandbytes.nn")
    linear8 = getattr(bnb, "Linear8bitLt", None)
    for module in (model.modules() if modules is None else modules):
        if linear8 is not None and isinstance(module, linear8):
            return True
        weight = module._parameters.get("weight") if hasattr(module, "_parameters") else None
        if weight is not None and getattr(weight, "act_quant_kwargs", None) is not None \
                and getattr(weight, "act_quant_scale", None) is None:
            return True
    return False
