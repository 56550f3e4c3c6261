"""The preallocated K/V storage both sides' caches are built on (the bottom layer of ``dflash``)."""

from .kv_buffer import CacheFullError, KVBuffer

__all__ = ["CacheFullError", "KVBuffer"]
