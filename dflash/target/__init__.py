"""The target side: the adapter that drives a Hugging Face decoder, its capture hooks, its cache, the
per-family capability table (:mod:`.families`), and the one registry of what an open adapter changes on the
model (:mod:`.patches`)."""

from .adapter import PREFILL_CHUNK, TargetAdapter, TargetStructureError, decoder_parts
from .attention import ATTENTION_NAME, AttentionPass, register_attention
from .cache import CacheFullError, TargetKVCache
from .hybrid import HybridKVCache
from .families import FAMILIES, Family, TargetSpec, UnsupportedTargetFeature, resolve_target

__all__ = ["ATTENTION_NAME", "AttentionPass", "CacheFullError", "FAMILIES", "Family", "HybridKVCache", "PREFILL_CHUNK", "TargetAdapter",
           "TargetKVCache", "TargetSpec", "TargetStructureError", "UnsupportedTargetFeature", "decoder_parts",
           "register_attention", "resolve_target"]
