"""The reference-compatible calls: generation in the argument order of the DFlash / DDTree reference code.

The core entry points are :func:`dflash.generate`, :func:`dflash.apply` and :func:`dflash.stream`; these two
forms exist only so that code written against the reference implementations runs unchanged:

* ``spec_generate(draft, target, input_ids, max_new_tokens, stop_token_ids=None, temperature=0.0, **kw)``:
  z-lab's ``draft.spec_generate(target=..., input_ids=..., ...)`` (the drafter's method,
  :meth:`dflash.drafter.model.DFlashDraftModel.spec_generate`, delegates here): ``dflash.generate(target,
  draft, input_ids, method="dflash", ...)`` returning only the ids ``[1, prompt + new]``.
* ``ddtree_generate(draft, target, input_ids, mask_token_id=None, max_new_tokens=128, ...)``: the DDTree
  reference's call (drafter first), returning the :class:`~dflash.decoding.result.GenerationResult`. Its
  ``temperature`` is the reference's plain softmax temperature: no ``target.generation_config`` defaults
  (top-k, top-p, ...) are read, as the reference reads none.
"""

from __future__ import annotations

from typing import Iterable, Optional

import torch

from .generate import generate
from .loop import generate_rounds
from .options import LoopOptions
from .result import GenerationResult

__all__ = ["ddtree_generate", "spec_generate"]


def spec_generate(draft, target, input_ids, max_new_tokens: int, stop_token_ids: Optional[Iterable[int]] = None,
                  temperature: float = 0.0, **kwargs) -> torch.Tensor:
    """DFlash generation with ``draft``: the output ids ``[1, prompt + new]``.

    ``target``: the HF causal LM; ``input_ids``: ``[T]`` or ``[1, T]``.
    Exactly :func:`dflash.generate` with ``method="dflash"`` (greedy at
    ``temperature=0``: the target's own greedy tokens; ``kwargs`` are its
    keywords), keeping only ``output_ids``; use :func:`dflash.generate` for
    the statistics.
    """
    result = generate(target, draft, input_ids, method="dflash", max_new_tokens=max_new_tokens,
                      temperature=temperature, stop_token_ids=stop_token_ids, **kwargs)
    return result.output_ids


def ddtree_generate(draft, target, input_ids, mask_token_id=None, max_new_tokens=128, block_size=None,
                    stop_token_ids=None, temperature=0.0, tree_budget=None, seed=None,
                    return_trees: bool = False) -> GenerationResult:
    """DDTree generation in the reference implementation's argument order (eager rounds).

    ``tree_budget`` None: ``2 * (B - 1)`` draft nodes per round (the reference's budget; ``"auto"`` or an
    int as in :func:`dflash.generate`). Returns a :class:`GenerationResult`: ``output_ids`` plus tau,
    acceptance lengths, per-round tree sizes and accepted depths, timings, and with ``return_trees=True``
    each round's tree (tokens, depths, parents) and accepted node indices.
    """
    options = LoopOptions(max_new_tokens=max_new_tokens, temperature=temperature, stop_token_ids=stop_token_ids,
                          block_size=block_size, seed=seed, tree_budget=tree_budget, mask_token_id=mask_token_id,
                          return_trees=return_trees)
    return generate_rounds(target, draft, input_ids, "ddtree", options, compile=False)
