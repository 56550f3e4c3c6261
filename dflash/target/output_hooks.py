"""transformers' output-capturing hooks made inert while a round's steps are traced.

A model called once with ``output_hidden_states=True`` (or any recorded output)
keeps forward hooks on its layers for good; each hook looks its collector up in a
``contextvars.ContextVar`` and returns at once when there is none (every pass of
ours). Dynamo cannot trace ``ContextVar.get``, so such a model's compiled steps
failed to trace although the hooks do nothing in them. transformers' wrapper
(``CompileableContextVar``) answers ``get`` from a plain attribute once it is in
its compiling state; :func:`inert_output_hooks` puts it there, with no collector,
around each traced step call, and restores what it found. A step is never run
inside a user's collecting forward (the round's own passes only), so "no
collector" is what the hooks would have seen anyway.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

__all__ = ["inert_output_hooks"]


def _collector():
    """transformers' active-collector variable, or None where this transformers has none of that form."""
    try:
        from transformers.utils import output_capturing
    except ImportError:
        return None
    var = getattr(output_capturing, "_active_collector", None)
    if var is None or not all(hasattr(var, name) for name in ("compiling", "global_var", "get")):
        return None
    return var


@contextlib.contextmanager
def inert_output_hooks() -> Iterator[None]:
    """Within: the hooks see no collector through a traceable path (see the module docstring)."""
    var = _collector()
    if var is None:
        yield
        return
    saved = (var.compiling, var.global_var)
    var.compiling, var.global_var = True, None
    try:
        yield
    finally:
        var.compiling, var.global_var = saved
