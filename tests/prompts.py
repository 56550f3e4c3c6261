"""The prompts the tests decode and the reference every lossless test compares with: the target's own greedy text.

Every prompt's tokens are below 64, the smallest tiny vocabulary (:mod:`tiny_models`, :mod:`zoo`). Tests whose
prompt has another length keep their own, named where they define it: an expected acceptance, bucket or
round count may have been set on its length.
"""

from __future__ import annotations

import torch

#: The prompt most generation tests decode (ten tokens).
PROMPT = [5, 17, 33, 2, 9, 41, 60, 7, 3, 12]
#: Nine tokens: the compiled-round, attention-function and target-norm tests'.
SHORT_PROMPT = [5, 17, 33, 2, 9, 41, 60, 7, 3]
#: Twelve tokens: the family tests' (tests/families/test_families.py, test_hybrid.py, test_own_forward_check.py, the zoo).
FAMILY_PROMPT = [5, 17, 33, 2, 9, 41, 60, 7, 3, 12, 8, 1]


def greedy(target, n: int, prompt=PROMPT, *, inference_mode: bool = False) -> torch.Tensor:
    """The target's own greedy decoding of ``prompt`` (a list of ids), ``n`` new tokens: transformers'
    ``generate(do_sample=False)``, ``[1, len(prompt) + n]`` ids. ``inference_mode``: under
    ``torch.inference_mode()`` rather than ``torch.no_grad()``."""
    with torch.inference_mode() if inference_mode else torch.no_grad():
        return target.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False)
