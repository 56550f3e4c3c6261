"""The DFlash drafter: config and target-layer mapping, the model (published checkpoint format), its cache."""

from .cache import DraftKVCache
from .config import DraftConfigError, default_target_layer_ids, make_draft_config, validate_target_layer_ids
from .model import DFlash2DraftModel, DFlashDraftModel

__all__ = ["DFlash2DraftModel", "DFlashDraftModel", "DraftConfigError", "DraftKVCache", "default_target_layer_ids", "make_draft_config",
           "validate_target_layer_ids"]
