"""dflash: DFlash and DDTree speculative decoding on Hugging Face transformers.

``dflash.generate(target, draft, input_ids, method="ar"|"dflash"|"ddtree", ...)``
is the entry point; :class:`DFlashDraftModel` is the drafter.

Subpackages, each importing only the ones listed after it: ``benchmark``,
``training``, ``tiny``, ``decoding``, ``target``, ``drafter`` (and the bottom
module ``kv_buffer``). See docs/ARCHITECTURE.md.
"""

from .decoding import GenerationResult, generate, spec_generate, warmup
from .drafter import DFlashDraftModel, DraftConfigError, default_target_layer_ids, make_draft_config
from .target import TargetAdapter, TargetStructureError

# The drafter's drop-in method lives with the loops (above the drafter layer); the package root,
# which sits above both, attaches it.
DFlashDraftModel.spec_generate = spec_generate

__all__ = [
    "DFlashDraftModel",
    "DraftConfigError",
    "GenerationResult",
    "TargetAdapter",
    "TargetStructureError",
    "default_target_layer_ids",
    "generate",
    "make_draft_config",
    "warmup",
]
