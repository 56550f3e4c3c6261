"""The target side: the adapter that drives a Hugging Face decoder, its capture hooks, its cache, the
per-family capability table (:mod:`.families`), and the one registry of what an open adapter changes on the
model (:mod:`.patches`).

Exported here is what the layers above use: :class:`TargetAdapter` (and ``PREFILL_CHUNK``, its prefill
chunk), :func:`decoder_parts`, :class:`TargetKVCache`, ``ATTENTION_NAME`` (the attention function our
passes register) and the two refusals, :class:`TargetStructureError` and :class:`UnsupportedTargetFeature`;
everything else is imported from its module.
"""

from .adapter import PREFILL_CHUNK, TargetAdapter, TargetStructureError, decoder_parts
from .attention import ATTENTION_NAME
from .cache import TargetKVCache
from .families import UnsupportedTargetFeature

__all__ = ["ATTENTION_NAME", "PREFILL_CHUNK", "TargetAdapter", "TargetKVCache", "TargetStructureError",
           "UnsupportedTargetFeature", "decoder_parts"]
