"""Pure-torch references of every dflash_kernels op: the spec in code.

The fast paths are tested against these; they are also the fallback when no
Triton backend is usable. One module per op family; all names re-exported.
"""

from .gather import *  # noqa: F401,F403
from .lm_head import *  # noqa: F401,F403
from .cross_entropy import *  # noqa: F401,F403
from .tree import *  # noqa: F401,F403
from .tree_attention import *  # noqa: F401,F403
from .split_attention import *  # noqa: F401,F403
from .kv_compaction import *  # noqa: F401,F403
from .sampling import *  # noqa: F401,F403
from .rejection import *  # noqa: F401,F403
from .gated_delta import *  # noqa: F401,F403
from .dynamic_conv import *  # noqa: F401,F403
from .selector import *  # noqa: F401,F403
from .selector_tree import *  # noqa: F401,F403
