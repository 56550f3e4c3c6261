"""Chooses the implementation of every op: ``triton`` or ``reference``.

* ``triton``: the Triton kernels, compiled for a CUDA GPU, or run by Triton's
  CPU interpreter when ``TRITON_INTERPRET=1`` was set before Triton was
  imported (that is how the test suite runs them on CPU tensors).
* ``reference``: the pure-torch ops of :mod:`dflash_kernels.reference`.

Triton is a dependency of the package (every kernel module imports it); the
reference backend needs no GPU, not Triton's absence. The default is
``triton`` when the tensors live on a CUDA device or the interpreter is on;
otherwise ``reference``. Force a path
with ``DFLASH_BACKEND=triton|reference`` in the environment, or in code with
``force_backend("reference")`` (a context manager that also works as a plain
call; ``force_backend(None)`` restores the default). A caller that fixes the
backend once (a compiled round, for a whole generation) passes it to an op as
``backend=``, which :func:`resolve_backend` honours.

Under ``torch.compile`` (:func:`tracing`), an op on the Triton backend calls its
``torch.library`` custom op (:mod:`dflash_kernels.ops`): one opaque node in the
graph, its launches captured by a CUDA graph; on the reference backend the
pure-torch reference is traced inline (inductor fuses it with its neighbours).
"""

from __future__ import annotations

import contextlib
import functools
import os
from typing import Iterator, Optional

import torch

BACKENDS = ("triton", "reference")

_forced: Optional[str] = None


def _check_name(name: Optional[str]) -> Optional[str]:
    if name is not None and name not in BACKENDS:
        raise ValueError(f"unknown dflash_kernels backend {name!r}; allowed: {', '.join(BACKENDS)} or None")
    return name


def triton_interpreting() -> bool:
    """True when Triton's CPU interpreter is switched on (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def available_backends(device: Optional[torch.device] = None) -> list:
    """Backends that can run on ``device`` (default: CUDA if present, else CPU)."""
    if device is None:
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    out = []
    if device.type == "cuda" or triton_interpreting():
        out.append("triton")
    out.append("reference")
    return out


@contextlib.contextmanager
def _restore(previous: Optional[str]) -> Iterator[None]:
    global _forced
    try:
        yield
    finally:
        _forced = previous


def force_backend(name: Optional[str]):
    """Force every op onto ``name`` ('triton', 'reference') or back to the default (None).

    Usable as ``force_backend('reference')`` (stays until changed) or as
    ``with force_backend('reference'): ...`` (restored on exit).
    """
    global _forced
    previous = _forced
    _forced = _check_name(name)
    return _restore(previous)


def get_backend(device: torch.device) -> str:
    """The backend an op on tensors of ``device`` runs on now."""
    name = _forced or _check_name(os.environ.get("DFLASH_BACKEND") or None)
    if name == "triton":
        if device.type != "cuda" and not triton_interpreting():
            raise RuntimeError(
                f"backend 'triton' was forced for tensors on {device}, but Triton needs a CUDA device or "
                "TRITON_INTERPRET=1 set before triton is imported"
            )
        return "triton"
    if name == "reference":
        return "reference"
    return "triton" if "triton" in available_backends(device) else "reference"


def resolve_backend(backend: Optional[str], device: torch.device) -> str:
    """``backend`` when the caller fixed one ('triton' or 'reference'), else :func:`get_backend` of ``device``.

    A fixed 'triton' on a device it cannot run on (CPU tensors without the interpreter) is refused by name,
    rather than left to fail inside Triton's launcher."""
    if backend is None:
        return get_backend(device)
    name = _check_name(backend)
    if name == "triton" and torch.device(device).type != "cuda" and not triton_interpreting():
        raise ValueError(f"backend 'triton' runs on CUDA tensors (or on the CPU with TRITON_INTERPRET=1 set before "
                         f"triton is imported); these tensors are on {torch.device(device)}: move them to a GPU or "
                         "use backend='reference'")
    return name


def tracing() -> bool:
    """True while ``torch.compile`` traces the caller (ops then go through their registered custom ops)."""
    return torch.compiler.is_compiling()


@functools.lru_cache(maxsize=None)
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def multiprocessor_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (read once per device, no sync): what launchers size their
    grids' waves by."""
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


#: The GPU architecture (``major * 10 + minor``) whose launch tables a device that is no GPU (the interpreter) uses.
DEFAULT_ARCH = 90


@functools.lru_cache(maxsize=None)
def _cuda_arch(device_index: int) -> int:
    major, minor = torch.cuda.get_device_capability(device_index)
    return major * 10 + minor


def device_arch(device: torch.device) -> int:
    """``major * 10 + minor`` of a CUDA device (read once per device, no sync): what per-arch launch tables are
    keyed by; :data:`DEFAULT_ARCH` elsewhere."""
    if device.type != "cuda":
        return DEFAULT_ARCH
    return _cuda_arch(device.index if device.index is not None else torch.cuda.current_device())
