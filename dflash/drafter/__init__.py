"""The DFlash drafter: config and target-layer mapping, the model (every checkpoint format), its cache.

Exported here is what the layers above use: :class:`DFlashDraftModel` / :class:`DFlash2DraftModel` (the one
drafter class and its DFlash2 form), :class:`DraftConfigError`, :func:`make_draft_config` and
:func:`default_target_layer_ids`; everything else is imported from its module.
"""

from .config import DraftConfigError, default_target_layer_ids, make_draft_config
from .model import DFlash2DraftModel, DFlashDraftModel

__all__ = ["DFlash2DraftModel", "DFlashDraftModel", "DraftConfigError", "default_target_layer_ids", "make_draft_config"]
