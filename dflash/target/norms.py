"""The target's RMSNorm modules as one op each inside our passes, on the CPU, where that is their own bits.

A decoder layer of most families runs four RMSNorms (input, post-attention, the query and key norms), each six
dispatched ops in the module's own Python (``pow, mean, add, rsqrt, mul, mul``): a quarter of a tiny target's
round. ``dflash_kernels.reference.rms_norm`` computes the same formula as one ``torch.rms_norm`` call on the CPU,
whose composite runs the formula's ops in the formula's order.

A module is taken only when :func:`~dflash.target.final_norm.fusable_norm` finds its output equal to that
formula bit for bit on probe rows (the check the fused lm_head already makes of the final norm, remembered
per module and weight), and only on the CPU (elsewhere the formula's ops run either way). While an
adapter holds the patch, the module's ``forward`` dispatches: inside one of our passes
(:func:`dflash.target.attention.active_pass`) the one op, for every other call (the user's own forward) the
forward it had.
"""

from __future__ import annotations

from typing import List, Sequence

import torch

from dflash_kernels.reference import rms_norm

from .attention import in_active_pass
from .final_norm import fusable_norm
from .patches import Patch

__all__ = ["norm_patches"]

def _norm_modules(modules: Sequence) -> List[torch.nn.Module]:
    """The leaf modules among ``modules`` named like a norm, with a 1-D weight on the CPU."""
    out = []
    for module in modules:
        if "Norm" not in type(module).__name__:
            continue
        weight = getattr(module, "weight", None)
        if (isinstance(weight, torch.Tensor) and weight.dim() == 1 and weight.device.type == "cpu"
                and not any(True for _ in module.children())):
            out.append(module)
    return out


def _dispatcher(eps: float):
    def wrap(module, original):
        def forward(hidden_states, *args, **kwargs):
            if in_active_pass() and not args and not kwargs:
                return rms_norm(hidden_states, module.weight, eps)
            return original(hidden_states, *args, **kwargs)

        return forward

    return wrap


#: one wrap per epsilon, so two adapters open on one model agree on the patch they hold
_WRAPS = {}


def norm_patches(modules: Sequence) -> list:
    """The patches that run each fusable CPU RMSNorm among ``modules`` (a model's ``modules()``) as one op inside
    our passes."""
    patches = []
    for module in _norm_modules(modules):
        eps = fusable_norm(module)
        if eps is None:
            continue
        wrap = _WRAPS.setdefault(eps, _dispatcher(eps))
        patches.append(Patch(module, "forward", wrap=wrap, shadow=True, label="RMSNorm forward"))
    return patches
