"""Tell numerics from bugs when a greedy output differs from ``target.generate()``.

At the first position where two greedy continuations of the same prompt
differ, :func:`first_divergence` runs the target on the common prefix and
reports the fp32 margin between the two tokens' logits. A margin of a few
units in the last place of the model's dtype is a near-tie that a different
summation order may flip (numerics); a large margin means the loop chose a
token the target does not prefer (a bug).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

__all__ = ["Divergence", "first_divergence"]


@dataclass
class Divergence:
    """First differing position of two outputs (index into the full sequence, prompt included)."""

    index: int
    expected: Optional[int]  # the reference's token there (None: the reference ended)
    got: Optional[int]  # the other output's token there (None: it ended)
    logit_margin: Optional[float]  # fp32 logits at that position: logit[expected] - logit[got]
    top2_gap: Optional[float]  # fp32 gap between the two best logits there

    def describe(self) -> str:
        if self.logit_margin is None:
            return f"outputs differ in length at index {self.index}"
        kind = "a near-tie (numerics)" if abs(self.logit_margin) <= 0.05 * max(1.0, abs(self.top2_gap or 0)) else "not a tie"
        return (f"first divergence at index {self.index}: expected {self.expected}, got {self.got}; "
                f"fp32 logit margin {self.logit_margin:.4g} (top-2 gap {self.top2_gap:.4g}): {kind}")


@torch.inference_mode()
def first_divergence(target, reference: Sequence[int], other: Sequence[int]) -> Optional[Divergence]:
    """None when equal; else where they first differ and the target's fp32 logit margin there."""
    ref = [int(t) for t in (reference.flatten().tolist() if isinstance(reference, torch.Tensor) else reference)]
    out = [int(t) for t in (other.flatten().tolist() if isinstance(other, torch.Tensor) else other)]
    for i, (a, b) in enumerate(zip(ref, out)):
        if a != b:
            break
    else:
        if len(ref) == len(out):
            return None
        i = min(len(ref), len(out))
        return Divergence(i, ref[i] if i < len(ref) else None, out[i] if i < len(out) else None, None, None)
    device = next(target.parameters()).device  # a wrapped or quantized target too
    logits = target(input_ids=torch.tensor([ref[:i]], device=device)).logits[0, -1].float()
    top2 = torch.topk(logits, 2).values
    return Divergence(i, ref[i], out[i], float(logits[ref[i]] - logits[out[i]]), float(top2[0] - top2[1]))
