"""Why the compiled rounds could not be built: :class:`CompileUnsupported` and the toolchain diagnosis.

A failure while tracing, compiling or capturing a round's steps
(:meth:`~dflash.decoding.compiled.RoundSteps.prepare`) becomes one
:class:`CompileUnsupported` naming its cause and the way out (``compile=False``).
One toolchain failure is recognised and explained: setuptools' own check
``assert '_distutils' in core.__file__, core.__file__``, which fails when the
standard library's distutils was imported before setuptools (on Python < 3.12,
importing pip first switches setuptools' distutils shim off) and inductor then
imports setuptools; inductor raises it wrapped
(``InductorError: AssertionError: .../distutils/core.py``), so the exception's
causes, contexts and inner exceptions are searched for it.
"""

from __future__ import annotations

import re
from typing import Optional

__all__ = ["CompileUnsupported", "distutils_core_path", "unsupported"]


class CompileUnsupported(RuntimeError):
    """The target (or a setting) cannot be run as compiled fixed-shape rounds; run with ``compile=False``."""


_DISTUTILS_CORE = re.compile(r"(?:AssertionError: )?(\S*distutils[\\/]core\.py)")


def distutils_core_path(exc: BaseException) -> Optional[str]:
    """The path in setuptools' check ``assert '_distutils' in core.__file__, core.__file__`` when ``exc`` is
    that failure or wraps it (inductor raises it as ``InductorError: AssertionError: .../distutils/core.py``)."""
    seen, todo = set(), [exc]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        text = str(e).strip()
        first = text.splitlines()[0].strip() if text else ""
        if isinstance(e, AssertionError) or first.startswith("AssertionError: "):
            m = _DISTUTILS_CORE.fullmatch(first)
            if m:
                return m.group(1)
        todo += [getattr(e, "inner_exception", None), e.__cause__, e.__context__]
    return None


def unsupported(model_name: str, exc: BaseException) -> CompileUnsupported:
    """The :class:`CompileUnsupported` for a failure while compiling or capturing the steps."""
    path = distutils_core_path(exc)
    if path is not None:
        return CompileUnsupported(
            f"torch.compile could not build the compiled rounds: setuptools failed to load its own distutils "
            f"(AssertionError: {path}). The standard library's distutils was imported before setuptools: on "
            "Python < 3.12, importing pip (or anything that switches off setuptools' distutils shim) before "
            "setuptools makes `import distutils` load the standard library's copy, and setuptools' check of its "
            "own copy then fails when torch.compile imports it. Import setuptools before anything imports pip "
            "or distutils (e.g. `import setuptools` at the top of the program), or set "
            "SETUPTOOLS_USE_DISTUTILS=stdlib in the environment; or run with compile=False.")
    text = str(exc)
    return CompileUnsupported(
        f"{model_name} cannot be run as compiled rounds ({type(exc).__name__}: "
        f"{text.splitlines()[0] if text else ''}); run it with compile=False")
