"""dflash: DFlash and DDTree speculative decoding on Hugging Face transformers.

``dflash.apply(target, draft)`` makes an unchanged ``target.generate(...)`` speculative
(undone by ``dflash.unapply(target)``); ``dflash.generate(target, draft, input_ids,
method="ar"|"dflash"|"ddtree", ...)`` is the direct entry point (transformers' generate
keywords, a :class:`GenerationResult` with the statistics); ``dflash.stream(...)`` yields each
round's tokens. These three are the core; the reference implementations' call forms
(``draft.spec_generate(target=..., input_ids=...)``, drafter-first ``ddtree_generate``) are in
:mod:`dflash.decoding.compat`. :class:`DFlashDraftModel` (and :class:`DFlash2DraftModel`) is the
drafter, the one class of :mod:`dflash.drafter.model`.

Subpackages, each importing only the ones listed after it: ``benchmark``,
``training``, ``tiny``, ``decoding``, ``target``, ``drafter`` (and the bottom
package ``cache``). See docs/ARCHITECTURE.md.
"""

from .decoding import GenerationResult, SamplingSettings, UnsupportedGeneration, apply, generate, stream, unapply, warmup
from .drafter import DFlash2DraftModel, DFlashDraftModel, DraftConfigError, default_target_layer_ids, make_draft_config
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
