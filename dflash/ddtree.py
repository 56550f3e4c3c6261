"""Public alias of the DDTree loop: ``from dflash.ddtree import ddtree_generate``.

The entry points live in :mod:`dflash.decoding.entry`; this module keeps the documented import path.
"""

from .decoding.entry import ddtree_generate, ddtree_generate_result

__all__ = ["ddtree_generate", "ddtree_generate_result"]
