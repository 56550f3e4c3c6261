"""The public drafter class: the drafter network with the one generation method the README documents.

:class:`dflash.drafter.model.DFlashDraftModel` is the network (config, layers,
checkpoint formats, forward); it knows nothing of the loops, which sit above
it. This layer's :class:`DFlashDraftModel` subclasses it only to add
:meth:`DFlashDraftModel.spec_generate`, the drafter-first drop-in call
``draft.spec_generate(target=..., input_ids=..., ...)`` (a generation
method on the drafter object, as DFlash drafters are commonly driven).
``dflash.DFlashDraftModel`` is this class, so a
drafter loaded through the package (``from_pretrained``, the tiny pair) has
the method; every loop also takes a plain network instance.
"""

from __future__ import annotations

from typing import Iterable, Optional

import torch

from ..drafter import model
from .generate import generate


class DFlashDraftModel(model.DFlashDraftModel):
    """The DFlash drafter (:class:`dflash.drafter.model.DFlashDraftModel`) plus :meth:`spec_generate`."""

    def spec_generate(self, target, input_ids, max_new_tokens: int, stop_token_ids: Optional[Iterable[int]] = None,
                      temperature: float = 0.0, **kwargs) -> torch.Tensor:
        """DFlash generation with this drafter: the output ids ``[1, prompt + new]``.

        ``target``: the HF causal LM; ``input_ids``: ``[T]`` or ``[1, T]``.
        Exactly :func:`dflash.generate` with ``method="dflash"`` (greedy at
        ``temperature=0``: the target's own greedy tokens; ``kwargs`` are its
        keywords), keeping only ``output_ids``; use :func:`dflash.generate` for
        the statistics.
        """
        result = generate(target, self, input_ids, method="dflash", max_new_tokens=max_new_tokens,
                          temperature=temperature, stop_token_ids=stop_token_ids, **kwargs)
        return result.output_ids


class DFlash2DraftModel(model.DFlash2DraftModel, DFlashDraftModel):
    """The DFlash2 drafter (:class:`dflash.drafter.model.DFlash2DraftModel`) plus :meth:`spec_generate`."""


DFlashDraftModel.dflash2_class = DFlash2DraftModel
DFlash2DraftModel.dflash2_class = DFlash2DraftModel
