"""dflash: DFlash and DDTree speculative decoding on Hugging Face transformers.

``dflash.apply(target, draft)`` makes an unchanged ``target.generate(...)`` speculative
(undone by ``dflash.unapply(target)``); ``dflash.generate(target, draft, input_ids,
method="ar"|"dflash"|"ddtree", ...)`` is the direct entry point (transformers' generate
keywords, a :class:`GenerationResult` with the statistics); ``dflash.stream(...)`` yields each
round's tokens; :class:`DFlashDraftModel` is the drafter (the network of :mod:`dflash.drafter` with
``draft.spec_generate(target=..., input_ids=...)``, defined in :mod:`dflash.decoding.drafter`).

Subpackages, each importing only the ones listed after it: ``benchmark``,
``training``, ``tiny``, ``decoding``, ``target``, ``drafter`` (and the bottom
package ``cache``). See docs/ARCHITECTURE.md.
"""

from .decoding import (DFlash2DraftModel, DFlashDraftModel, GenerationResult, SamplingSettings, UnsupportedGeneration, apply, generate,
                       stream, unapply, warmup)
from .drafter import DraftConfigError, default_target_layer_ids, make_draft_config
from .target import TargetAdapter, TargetStructureError

__all__ = [
    "DFlash2DraftModel",
    "DFlashDraftModel",
    "DraftConfigError",
    "GenerationResult",
    "SamplingSettings",
    "TargetAdapter",
    "TargetStructureError",
    "UnsupportedGeneration",
    "apply",
    "default_target_layer_ids",
    "generate",
    "make_draft_config",
    "stream",
    "unapply",
    "warmup",
]
