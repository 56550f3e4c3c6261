"""The decoding layer: the one round (draft + verify over device state), the host loop, and the entry points.

Its users outside the layer need: :func:`generate`, :func:`apply` / :func:`unapply` / :func:`is_applied`
(the transformers drop-in), :func:`stream`, :func:`warmup`, the :class:`GenerationResult` they return,
:class:`SamplingSettings`, :class:`UnsupportedGeneration` and :func:`check_pair` (a drafter against its
target, for training). The reference-compatible calls (``spec_generate``, drafter-first
``ddtree_generate``) are in :mod:`dflash.decoding.compat`; everything else is imported from its module.
"""

from .generate import generate
from .generation_config import SamplingSettings, UnsupportedGeneration
from .hf import apply, is_applied, unapply
from .options import check_pair
from .result import GenerationResult
from .streaming import stream
from .warmup import warmup

__all__ = ["GenerationResult", "SamplingSettings", "UnsupportedGeneration", "apply", "check_pair", "generate",
           "is_applied", "stream", "unapply", "warmup"]
