"""dflash: DFlash and DDTree speculative decoding on Hugging Face transformers.

``dflash.generate(target, draft, input_ids, method="ar"|"dflash"|"ddtree", ...)``
is the entry point; :class:`DFlashDraftModel` is the drafter.
"""

from .config import DraftConfigError, default_target_layer_ids, make_draft_config
from .generate import GenerationResult, generate
from .model import DFlashDraftModel
from .target import TargetAdapter, TargetStructureError

__all__ = [
    "DFlashDraftModel",
    "DraftConfigError",
    "GenerationResult",
    "TargetAdapter",
    "TargetStructureError",
    "default_target_layer_ids",
    "generate",
    "make_draft_config",
]
