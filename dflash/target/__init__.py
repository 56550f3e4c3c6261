"""The target side: the adapter that drives a Hugging Face decoder, its capture hooks, and its cache."""

from .adapter import PREFILL_CHUNK, TargetAdapter, TargetStructureError, decoder_parts
from .attention import ATTENTION_NAME, AttentionPass, register_attention
from .cache import CacheFullError, TargetKVCache

__all__ = ["ATTENTION_NAME", "AttentionPass", "CacheFullError", "PREFILL_CHUNK", "TargetAdapter", "TargetKVCache",
           "TargetStructureError", "decoder_parts", "register_attention"]
