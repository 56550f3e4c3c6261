"""The target side: the adapter that drives a Hugging Face decoder, its capture hooks, and its cache."""

from .adapter import TREE_ATTENTION, TargetAdapter, TargetStructureError, decoder_parts, register_tree_attention
from .cache import CacheFullError, TargetKVCache

__all__ = ["CacheFullError", "TREE_ATTENTION", "TargetAdapter", "TargetKVCache", "TargetStructureError",
           "decoder_parts", "register_tree_attention"]
