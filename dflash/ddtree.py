"""Public alias of the DDTree loop: ``from dflash.ddtree import ddtree_generate``.

The loop lives in :mod:`dflash.decoding.ddtree`; this module keeps the documented import path.
"""

from .decoding.ddtree import ddtree_generate, ddtree_generate_result

__all__ = ["ddtree_generate", "ddtree_generate_result"]
