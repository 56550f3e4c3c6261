"""Counting the device kernels a piece of eager PyTorch code launches, on any device (a CPU included).

:class:`LaunchCounter` is a ``TorchDispatchMode``: every aten (or registered custom) op that reaches the
dispatcher is one launch on a GPU, except

* view and metadata ops (``view``, ``slice``, ``expand``, ``transpose``, ``unsqueeze``, ``item``, ...) and bare
  allocations (``empty``), which launch nothing;
* an out-of-place op whose result is one of its inputs or a view of one (``x.to(x.dtype)``,
  ``x.contiguous()`` of a contiguous ``x``, ``reshape`` as a view): it returned without computing.

A registered custom op counts once (its kernel is one launch; the Python reference behind it runs below the
mode and is not seen). Triton launches (``JITFunction.run``, ``InterpretedFunction.run`` under the
interpreter) count once each, the interpreter's own tensor traffic inside them not at all.

Counts depend on the autograd state, as the dispatcher's do: under ``torch.inference_mode()`` composite ops
(``linear``, ``scaled_dot_product_attention``) arrive whole, under ``no_grad`` decomposed. Compare
implementations under the same state (every generation loop here runs in inference mode).

This file imports nothing but torch, so a benchmark can load it by path into another environment
(``importlib.util.spec_from_file_location``) and count another package's loop with the same rules.
"""

from __future__ import annotations

import collections

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["FREE_OPS", "LaunchCounter"]

#: aten ops that launch nothing: views, metadata, allocation without a fill, host reads of a scalar
FREE_OPS = frozenset({
    "view", "_unsafe_view", "slice", "select", "expand", "as_strided", "t", "transpose", "permute", "detach",
    "alias", "unsqueeze", "squeeze", "reshape", "empty", "empty_like", "empty_strided", "lift_fresh", "unbind",
    "split", "split_with_sizes", "chunk", "unflatten", "flatten", "narrow", "view_as", "numpy_T", "resolve_conj",
    "resolve_neg", "item", "_local_scalar_dense", "sym_size", "sym_stride", "sym_numel", "sym_storage_offset",
    "is_contiguous", "promote_types", "result_type", "size", "stride", "dim", "is_same_size",
})


def _storages(value) -> set:
    """The storage pointers of the tensors in ``value`` (a tensor, or a list / tuple of them)."""
    if isinstance(value, torch.Tensor):
        return {value.untyped_storage().data_ptr()} if value.numel() else set()
    if isinstance(value, (list, tuple)):
        out = set()
        for v in value:
            out |= _storages(v)
        return out
    return set()


class LaunchCounter(TorchDispatchMode):
    """``with LaunchCounter() as c: ...`` then ``c.total`` (aten + Triton launches), ``c.aten``, ``c.triton`` and
    ``c.by_op`` (a ``Counter`` of the aten ops' base names)."""

    def __init__(self):
        super().__init__()
        self.aten = 0
        self.triton = 0
        self.by_op = collections.Counter()
        self._inside = 0  # > 0 while a Triton launch runs
        self._patched = []

    @property
    def total(self) -> int:
        return self.aten + self.triton

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self._inside:
            return out
        name = func.__name__.split(".")[0]
        if name in FREE_OPS:
            return out
        if not name.endswith("_") and (_storages(out) & _storages(list(args) + list((kwargs or {}).values()))):
            return out  # returned an input or a view of one: nothing computed
        self.aten += 1
        self.by_op[name] += 1
        return out

    def __enter__(self):
        try:
            import triton.runtime.jit as jit
            classes = [jit.JITFunction]
            try:
                from triton.runtime.interpreter import InterpretedFunction
                classes.append(InterpretedFunction)
            except ImportError:  # pragma: no cover - older triton
                pass
        except ImportError:  # pragma: no cover - no triton
            classes = []
        for cls in classes:
            real = cls.run

            def run(fn_self, *a, _real=real, **kw):
                if not kw.get("warmup", False):
                    self.triton += 1
                self._inside += 1
                try:
                    return _real(fn_self, *a, **kw)
                finally:
                    self._inside -= 1

            cls.run = run
            self._patched.append((cls, real))
        return super().__enter__()

    def __exit__(self, *exc):
        for cls, real in self._patched:
            cls.run = real
        self._patched.clear()
        return super().__exit__(*exc)
