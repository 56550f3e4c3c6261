"""Record the compile key of every Triton launch, under the interpreter as on a GPU.

The interpreter compiles nothing, so it cannot show a recompile; but which
binary a launch needs is decided by the arguments alone. :class:`LaunchKeys`
wraps ``InterpretedFunction.run`` and computes, per launch, the key the
compiling runtime would look up in its cache (Triton 3.x rules):

* constexpr arguments and launch options (``num_warps``, ``num_stages``): their values;
* tensors: dtype and whether the data pointer is 16-byte aligned;
* ints not in ``do_not_specialize``: whether they are 1 and whether they are divisible by 16,
  plus their width (i32 / i64); ints in ``do_not_specialize``: the width only;
* floats, bools, None: their type.

A launch whose key was never seen before would compile on a GPU.
"""

from __future__ import annotations

import inspect

import torch
from triton.runtime.interpreter import InterpretedFunction

_OPTIONS = ("num_warps", "num_stages", "num_ctas", "maxnreg")


def _int_width(x: int) -> str:
    return "i32" if -(2**31) <= x < 2**31 else ("i64" if -(2**63) <= x < 2**63 else "u64")


def _arg_key(value, specialize: bool):
    if isinstance(value, torch.Tensor):
        return ("tensor", str(value.dtype), value.data_ptr() % 16 == 0)
    if isinstance(value, bool):
        return ("i1",)
    if isinstance(value, int):
        if not specialize:
            return (_int_width(value),)
        return (_int_width(value), value == 1, value % 16 == 0)
    if isinstance(value, float):
        return ("fp32",)
    if value is None:
        return ("none",)
    return (type(value).__name__, repr(value))


class LaunchKeys:
    """Context manager: ``keys`` is the set of ``(kernel name, key)`` of the launches made inside."""

    def __init__(self):
        self.keys = set()
        self._real = None

    def _key(self, fn: InterpretedFunction, args, kwargs):
        sig = inspect.signature(fn.fn)
        names = list(sig.parameters)
        constexpr = {n for n, p in sig.parameters.items() if "constexpr" in str(p.annotation)}
        dns = set(fn.kwargs.get("do_not_specialize") or ())
        dns |= {names[i] for i in dns if isinstance(i, int)}
        bound = dict(zip(names, args))
        bound.update({k: v for k, v in kwargs.items() if k in sig.parameters})
        parts = []
        for name in names:
            if name not in bound:
                continue
            value = bound[name]
            parts.append((name, ("constexpr", repr(value)) if name in constexpr else _arg_key(value, name not in dns)))
        parts += [(k, kwargs[k]) for k in _OPTIONS if k in kwargs]
        return fn.fn.__name__, tuple(parts)

    def __enter__(self):
        self._real = real = InterpretedFunction.run
        recorder = self

        def run(fn_self, *args, grid, warmup, **kwargs):
            recorder.keys.add(recorder._key(fn_self, args, kwargs))
            return real(fn_self, *args, grid=grid, warmup=warmup, **kwargs)

        InterpretedFunction.run = run
        return self

    def __exit__(self, *exc):
        InterpretedFunction.run = self._real
