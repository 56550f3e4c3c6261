"""How an op is declared: its ``torch.library`` registration and its one route between backends.

Each kernel module declares its ops next to their kernels with two calls:

* :func:`declare` registers ``torch.ops.dflash.<name>`` (an overload ``<name>.<overload>`` where a public op
  takes an int or a tensor for a per-round value, as aten's ``add.Tensor`` / ``add.Scalar``). The schema is
  the decorated function's annotated signature (``torch.library.custom_op``), with the mutated arguments, the
  shape rule that gives output shapes from input shapes (:func:`shape_rule`: the op's fake, its parameters
  written once, in the signature), and an optional autograd formula.
  The decorated body is the public function again: the same validation and the same backend choice as
  :func:`dflash_kernels.get_backend` makes at run time.
* :func:`dispatch` is the route every public op takes once its arguments are validated: on the reference
  backend the pure-torch reference (traced inline by ``torch.compile``); on the Triton backend, while
  ``torch.compile`` traces, the registered custom op (one opaque node, its launches captured by a CUDA graph);
  otherwise the Triton launcher, directly.

Constraints every declaration keeps (they hold from the torch floor, 2.11, up):

* a mutating op returns nothing (``-> ()``, its shape rule returns None; the caller keeps its own reference to the
  buffer): tagged in-place / ``out=`` ops returning their mutated input, and keyword-only tensor arguments,
  exist only from torch 2.13;
* a mutated argument is never defaulted (torch before 2.13 bumps its version counter by position);
* ``custom_op``, not ``triton_op``: ``triton_op`` traces its body with fake tensors, and the launchers read host
  values of their inputs (``gather_concat``'s pointer table of ``data_ptr()`` s, the lm_head's vocab chunk
  loops, the debug checks) and launch kernels directly rather than through ``torch.library.wrap_triton``;
* schema types: Python ints are ``SymInt``, floats ``float``, optional tensors ``Tensor?``, tensor lists
  ``Tensor[]``, dtypes ``ScalarType``; a schema has no ``torch.Generator`` (samplers take a seed) and no
  Python lists of indices (``positions`` / ``rows`` are tensors).
"""

from __future__ import annotations

import inspect
from types import SimpleNamespace
from typing import Callable, Iterable, Optional, Tuple

import torch

from ._dispatch import resolve_backend, tracing

NAMESPACE = "dflash"


def shape_rule(signature: inspect.Signature, rule: Callable) -> Callable:
    """The fake (meta) implementation of an op of parameters ``signature``, from its shape rule.

    ``rule(a)`` takes ``a``, a namespace of the op's arguments by name, defaults applied
    (``signature.bind(*args, **kwargs)``: ``a.hidden``, ``a.positions`` ...), and returns new empty tensors of
    the output shapes (on the inputs' fake device), or None for a mutating op. The returned fake binds its
    call and applies the rule; it carries ``signature`` (``__signature__``), so it reads as the op's.
    """
    def fake(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        return rule(SimpleNamespace(**bound.arguments))

    fake.__signature__ = signature
    return fake


def declare(name: str, *, fake: Callable, mutates: Iterable[str] = (),
            autograd: Optional[Tuple[Callable, Callable]] = None) -> Callable:
    """Decorator: register the decorated function as ``torch.ops.dflash.<name>``.

    ``name``: ``"op"`` or ``"op.overload"``. ``fake``: the op's shape rule (:func:`shape_rule`: a function of
    one namespace ``a`` of the op's arguments by name, no parameter list; returns new empty tensors of the
    output shapes, or None for a mutating op). ``mutates``: the names of the arguments written in place.
    ``autograd``: ``(backward, setup_context)`` for ``register_autograd``. Returns the ``torch.library``
    custom op object (callable like the op).
    """
    def register(impl: Callable):
        op = torch.library.custom_op(f"{NAMESPACE}::{name}", mutates_args=tuple(mutates))(impl)
        op.register_fake(shape_rule(inspect.signature(impl), fake))
        if autograd is not None:
            backward, setup_context = autograd
            op.register_autograd(backward, setup_context=setup_context)
        return op

    return register


def dispatch(backend: Optional[str], device, *, reference: Callable, triton: Callable, traced: Callable,
             opaque: bool = False, prepare: Optional[Callable] = None):
    """The route of a public op (arguments validated), each path a callable of no arguments.

    ``resolve_backend(backend, device)`` is ``'reference'``: ``reference()``; else ``traced()`` (the custom op)
    while ``torch.compile`` traces, ``triton()`` (the launcher) otherwise.

    ``opaque=True``: under ``torch.compile`` the op is the custom op on both backends (traced index math on a
    cache would be functionalized into a copy of the whole cache); then nothing else runs while tracing, and
    ``prepare()`` (the validation that reads storage or values) runs first on every other call.
    """
    if opaque and tracing():
        return traced()
    if prepare is not None:
        prepare()
    if resolve_backend(backend, device) == "reference":
        return reference()
    if tracing():
        return traced()
    return triton()
