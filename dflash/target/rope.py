"""The rotary embedding of a layer's queries and keys in eight dispatched ops instead of ten, the same bits.

transformers' canonical ``apply_rotary_pos_emb(q, k, cos, sin)`` (Llama's, copied into most families) runs
``x * cos + rotate_half(x) * sin`` for ``x = q`` and ``x = k``, with ``rotate_half(x) = cat(-x2, x1)`` over
the halves ``x = [x1, x2]`` of the head dim ``D``: five ops per tensor (mul, neg, cat, mul, add), ten per
layer, each one kernel launch of an eager GPU pass. Inside our passes the module's function is replaced by

    x * cos + roll(x, D/2) * sin_signed,     sin_signed = [-sin1, sin2]

(``mul, roll, mul, add``: four ops per tensor). ``sin_signed`` depends on the pass only: the first layer
makes it (``neg`` and ``cat``), the others read it (:attr:`~dflash.target.attention.AttentionPass.memo`).
Bit for bit the model's: ``(-x2) * s1 == x2 * (-s1)`` exactly (negation is exact and rounding is symmetric
in sign), every other product and sum is the same op on the same operands in the same dtypes; and the
result's memory layout is the model's (the sum's first operand ``x * cos`` decides it in both). Rotating
``q`` and ``k`` as one tensor would save three more ops but hands the attention a head-major ``q``, whose
output some families ``view`` (afmoe): not the model's layout.

A modeling module is patched only when its ``apply_rotary_pos_emb`` and ``rotate_half`` have the bytecode and
defaults of transformers' Llama functions (partial, interleaved or multimodal ropes differ and keep theirs).
The patch dispatches: inside one of our eager passes (:func:`dflash.target.attention.current_pass`; not
under ``torch.compile``, whose fusion makes the ops one kernel anyway) with the canonical call
``(q, k, cos, sin)``, ``cos, sin [b, T, D]`` and an even ``D``, the eight ops; for every other call (the
user's own forward, any other form) the function it replaced.
"""

from __future__ import annotations

import sys
from typing import List

import torch

from .attention import current_pass
from .patches import Patch

__all__ = ["rope_patches", "rotate_pair"]


def _canonical():
    from transformers.models.llama import modeling_llama

    return modeling_llama.apply_rotary_pos_emb, modeling_llama.rotate_half


def _same_function(f, g) -> bool:
    code_f, code_g = getattr(f, "__code__", None), getattr(g, "__code__", None)
    return (code_f is not None and code_g is not None and code_f.co_code == code_g.co_code
            and code_f.co_names == code_g.co_names and code_f.co_varnames == code_g.co_varnames
            and f.__defaults__ == g.__defaults__)


def _canonical_module(module) -> bool:
    """Whether a modeling module's rope functions are transformers' canonical (Llama's) ones."""
    apply, rotate = _canonical()
    return (_same_function(getattr(module, "apply_rotary_pos_emb", None), apply)
            and _same_function(getattr(module, "rotate_half", None), rotate))


def _signed_sin(sin: torch.Tensor) -> torch.Tensor:
    """``[-sin1, sin2]`` over the halves of the last dim, once per pass and table (the pass's memo)."""
    attention_pass = current_pass()
    key = ("rope_sin", id(sin))
    entry = attention_pass.memo.get(key) if attention_pass is not None else None
    if entry is not None and entry[0] is sin:
        return entry[1]
    half = sin.shape[-1] // 2
    signed = torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)
    if attention_pass is not None:
        attention_pass.memo[key] = (sin, signed)  # the table is held with it: its id stays its own
    return signed


def rotate_pair(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """``(q_embed, k_embed)`` of the canonical ``apply_rotary_pos_emb(q, k, cos, sin)`` (``q [b, Hq, T, D]``,
    ``k [b, Hkv, T, D]``, ``cos, sin [b, T, D]``), bit for bit, in eight ops (see the module docstring)."""
    cos, sin = cos.unsqueeze(1), _signed_sin(sin).unsqueeze(1)
    half = q.shape[-1] // 2
    return (q * cos) + (torch.roll(q, half, dims=-1) * sin), (k * cos) + (torch.roll(k, half, dims=-1) * sin)


def _fits(q, k, cos, sin) -> bool:
    return (isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor) and q.dim() == 4 and k.dim() == 4
            and q.shape[-1] == k.shape[-1] and q.shape[-1] % 2 == 0 and isinstance(cos, torch.Tensor)
            and isinstance(sin, torch.Tensor) and cos.dim() == 3 and sin.shape == cos.shape
            and cos.shape[-1] == q.shape[-1])


def _wrap(module, original):
    def apply_rotary_pos_emb(q, k, cos, sin, *args, **kwargs):
        if (args or kwargs or current_pass() is None or torch.compiler.is_compiling()
                or not _fits(q, k, cos, sin)):
            return original(q, k, cos, sin, *args, **kwargs)
        return rotate_pair(q, k, cos, sin)

    return apply_rotary_pos_emb


def rope_patches(modules) -> List[Patch]:
    """The patches that run the canonical rope of the modeling modules behind ``modules`` (a model's
    ``modules()``) in eight ops inside our passes; none for a module with another rope."""
    seen, patches = set(), []
    for m in modules:
        name = type(m).__module__
        if name in seen or not name.startswith("transformers.models."):
            continue
        seen.add(name)
        module = sys.modules.get(name)
        if module is not None and _canonical_module(module):
            patches.append(Patch(module, "apply_rotary_pos_emb", wrap=_wrap, label="rotary embedding"))
    return patches
