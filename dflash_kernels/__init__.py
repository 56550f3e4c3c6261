"""dflash_kernels: the ops of DFlash / DDTree speculative decoding.

Every op has a pure-torch reference in :mod:`dflash_kernels.reference` (the
spec in code) and a fast path (Triton kernels, C++ for the tree build) chosen
by :mod:`dflash_kernels._dispatch`. This package knows nothing about models.

Each op has one public name here, takes ints or device tensors where a
compiled round needs the latter (``lm_head_sample(..., seed=int|Tensor)``,
``tree_attention(..., prefix_len=int|Tensor)``, ``compact_kv_(kv, rows,
dst_start=int|Tensor, num_rows=None|Tensor)``; ``compact_kv_`` and
``kv_write_`` also take a batch of caches ``[b, L, 2, Hkv, S, D]`` with
per-row tensors), and an optional ``backend=``
that fixes the backend. Under ``torch.compile`` the Triton path goes through
the op's ``torch.library`` registration, declared beside its kernel
(:mod:`dflash_kernels._declare`; :mod:`dflash_kernels.ops` imports them all).

Public ops (each family's module defines ``__all__``):

* gather + concat of captured layers: :mod:`.gather`
* final RMSNorm + lm_head at selected positions, fused with argmax / top-K:
  :mod:`.lm_head`; the one sampling head ``lm_head_sample`` (plain, or through
  top-k / top-p / min-p): :mod:`.sampling`; the training loss over the same
  GEMM, fused linear cross-entropy: :mod:`.cross_entropy`
* rejection sampling of a drafted chain (the lossless acceptance of sampled
  drafts, dense or sparse draft distribution): :mod:`.rejection`
* DDTree: the tree build (``build_tree``: C++ on the host, or on the device
  with ``on_device=True``; one tree or a batch, with the nodes' path scores)
  and walk (C++; on the device: ``walk_tree_device``), ancestor bitmask, tree attention and its torch
  visibility / masked-attention path, KV compaction and the cache row write
  (``kv_write_``, C++): :mod:`.tree`, :mod:`.tree_attention`, :mod:`.kv_compaction`
* hybrid targets' Gated-DeltaNet layers: tree scan, path replay, tree conv,
  conv window: :mod:`.gated_delta`
* DFlash2 drafters: the grouped dynamic causal conv (``dynamic_conv``) and the
  candidate selector's chain (``select_candidates``): :mod:`.dynamic_conv`,
  :mod:`.selector`
"""

import torch  # noqa: F401  (loads libtorch before the C++ extension)

from . import reference
from ._dispatch import available_backends, force_backend, get_backend
from .gather import *  # noqa: F401,F403
from .lm_head import *  # noqa: F401,F403
from .cross_entropy import *  # noqa: F401,F403
from .tree import *  # noqa: F401,F403
from .tree_attention import *  # noqa: F401,F403
from .kv_compaction import *  # noqa: F401,F403
from .sampling import *  # noqa: F401,F403
from .rejection import *  # noqa: F401,F403
from .gated_delta import *  # noqa: F401,F403
from .dynamic_conv import *  # noqa: F401,F403
from .selector import *  # noqa: F401,F403
from . import ops  # noqa: F401  (every torch.library registration: torch.ops.dflash.*)

__version__ = "0.1.0"
