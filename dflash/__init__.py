"""dflash: DFlash and DDTree speculative decoding on Hugging Face transformers.

``dflash.apply(target, draft)`` makes an unchanged ``target.generate(...)`` speculative
(undone by ``dflash.unapply(target)``); ``dflash.generate(target, draft, input_ids,
method="ar"|"dflash"|"ddtree", ...)`` is the direct entry point (transformers' generate
keywords, a :class:`GenerationResult` with the statistics); ``dflash.stream(...)`` yields each
round's tokens; :class:`DFlashDraftModel` is the drafter.

Subpackages, each importing only the ones listed after it: ``benchmark``,
``training``, ``tiny``, ``decoding``, ``target``, ``drafter`` (and the bottom
package ``cache``). See docs/ARCHITECTURE.md.
"""

from .decoding import (GenerationResult, SamplingSettings, UnsupportedGeneration, apply, generate, spec_generate,
                       stream, unapply, warmup)
from .drafter import DFlashDraftModel, DraftConfigError, default_target_layer_ids, make_draft_config
from .target import TargetAdapter, TargetStructureError

# The drafter's drop-in method lives with the loops (above the drafter layer); the package root,
# which sits above both, attaches it.
DFlashDraftModel.spec_generate = spec_generate

__all__ = [
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
