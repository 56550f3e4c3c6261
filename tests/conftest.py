"""Test setup: run Triton kernels under the CPU interpreter when no GPU is present.

``TRITON_INTERPRET`` must be set before triton is first imported, so this runs
before any test module imports ``dflash_kernels``. Set
``DFLASH_TEST_REAL_TRITON=1`` on a GPU machine to test the compiled kernels.
"""

import os

import torch

if not torch.cuda.is_available() and os.environ.get("DFLASH_TEST_REAL_TRITON") != "1":
    os.environ.setdefault("TRITON_INTERPRET", "1")

torch.set_num_threads(min(2, torch.get_num_threads()))


# ``--shard I/N``, ``--shard-preload`` and ``--only-listed FILE``: see sharding.py.
from sharding import (  # noqa: E402,F401  (tests/ is on sys.path, as for the helper modules)
    pytest_addoption,
    pytest_collection_modifyitems,
    pytest_ignore_collect,
    pytest_sessionfinish,
    pytest_terminal_summary,
)
