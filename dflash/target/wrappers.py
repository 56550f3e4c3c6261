"""The model inside the wrappers a user holds it in: the one place the target's decoder is found through them.

A user hands us the model as they use it, which is not always the transformers causal LM itself:

* ``torch.compile(model)`` returns an ``OptimizedModule`` whose ``_orig_mod`` is the model (its attribute
  access is forwarded there, so ``compiled.generate`` is the model's own ``generate``);
* peft's ``get_peft_model`` / ``PeftModel.from_pretrained`` return a ``PeftModel`` whose ``base_model`` (a
  ``LoraModel`` or another tuner) holds the transformers model as ``.model``, with the adapter layers injected
  in place of the wrapped linears (``lora.Linear`` around the original ``nn.Linear``, ...): calling the
  decoder's modules runs the adapters, the active ones, and honours ``with peft_model.disable_adapter():``;
* ``torch.nn.DataParallel`` / ``DistributedDataParallel`` hold it as ``.module``.

:func:`unwrap_target` peels these (nested in any order) and returns the model whose ``model.layers`` the
adapter drives; :func:`check_wrappers` refuses the wrappers whose effect is not in those modules (peft prompt
learning: virtual tokens or a prefix cache the wrapper adds to every forward's input). Wrapping the model's
``forward`` (``model.forward = torch.compile(model.forward)``) needs nothing: the adapter never calls it.

Nothing here imports peft: a ``PeftModel`` can only exist once peft was imported, so its classes are read
from ``sys.modules``.
"""

from __future__ import annotations

import contextlib
import sys
from typing import List

import torch

from .families import UnsupportedTargetFeature

__all__ = ["unwrap_target", "wrapper_chain", "check_wrappers", "plain_forward"]

#: wrappers deeper than this are a cycle or a mistake
MAX_DEPTH = 8


def _peft_classes():
    """``(PeftModel, BaseTuner)`` when peft is imported, else ``(None, None)``."""
    peft = sys.modules.get("peft")
    if peft is None:
        return None, None
    tuners = sys.modules.get("peft.tuners.tuners_utils")
    return getattr(peft, "PeftModel", None), getattr(tuners, "BaseTuner", None)


def _inner(model):
    """The model one wrapper in, or None when ``model`` is not a wrapper we know."""
    compiled = sys.modules.get("torch._dynamo.eval_frame")
    if compiled is not None and isinstance(model, compiled.OptimizedModule):
        return model._orig_mod
    peft_model, tuner = _peft_classes()
    if peft_model is not None and isinstance(model, peft_model):
        return model.base_model
    if tuner is not None and isinstance(model, tuner):
        return model.model
    if isinstance(model, (torch.nn.DataParallel, torch.nn.parallel.DistributedDataParallel)):
        return model.module
    return None


def wrapper_chain(model) -> List[object]:
    """``[model, ..., inner]``: the objects from what the user holds to the transformers model, outermost first."""
    chain = [model]
    while len(chain) <= MAX_DEPTH:
        inner = _inner(chain[-1])
        if inner is None:
            return chain
        chain.append(inner)
    raise TypeError(f"{type(model).__name__} is wrapped more than {MAX_DEPTH} deep "
                    f"({' -> '.join(type(m).__name__ for m in chain)})")


def unwrap_target(model):
    """The transformers model inside ``model``'s wrappers (``model`` itself when it wears none)."""
    return wrapper_chain(model)[-1]


def check_wrappers(model) -> None:
    """Refuse (:class:`UnsupportedTargetFeature`) a wrapper whose effect the decoder's modules do not carry.

    peft prompt learning (prefix tuning, prompt tuning, p-tuning) adds virtual tokens or a prefix cache to every
    forward's input in ``PeftModel.forward``; the adapter calls the decoder's layers itself, so it would run
    the base model without them."""
    peft_model, _ = _peft_classes()
    for outer in wrapper_chain(model):
        if peft_model is not None and isinstance(outer, peft_model):
            config = outer.active_peft_config
            if getattr(config, "is_prompt_learning", False):
                name = type(unwrap_target(model)).__name__
                raise UnsupportedTargetFeature(
                    name, f"peft prompt learning ({type(config).__name__})",
                    "its virtual tokens enter through PeftModel.forward, which a speculative round does not call "
                    "(adapters that live in the layers, LoRA / DoRA / IA3 / ..., are supported)")


@contextlib.contextmanager
def plain_forward(model):
    """Inside, ``model``'s class ``forward``, when ``model.forward = torch.compile(model.forward)`` shadows it on
    the instance (the same function, compiled): a one-off call of the model's own forward (the check against it
    when a target is first adapted) then costs no compile. Anything else is left as it is."""
    own = vars(model).get("forward")
    if own is None or not hasattr(own, "_torchdynamo_orig_callable"):
        yield
        return
    del model.forward
    try:
        yield
    finally:
        model.forward = own
