"""Compile Triton kernels for a real NVIDIA GPU without one, and report their resources.

Used by the ``test_compile_gpu_*`` tests of every kernel family: the CPU test
suite runs kernels under Triton's interpreter, which accepts code that a real
compile rejects (non-power-of-two aranges, bad dot shapes) and says nothing
about registers, spills or shared memory. ``compile_for_gpu`` runs Triton's
full NVIDIA pipeline (TTIR -> TTGIR -> LLVM -> PTX -> cubin with the ``ptxas``
shipped in Triton's wheel) for a chosen ``sm_XX`` and reads the resource usage
back with the wheel's ``cuobjdump --dump-resource-usage``. No GPU or driver is
needed.

Stable API (other test modules import it)::

    compile_for_gpu(kernel, signature, constexprs, arch=90, num_warps=4, num_stages=3,
                    *, divisible_by_16=()) -> dict
    compile_many_for_gpu(jobs, workers=2) -> list   # the same for many kernels, in parallel
    gpu_compile_unavailable_reason() -> Optional[str]
    require_gpu_compiler()          # pytest.skip(reason) when compiling is impossible here
    SHARED_MEMORY_LIMIT_BYTES       # {80: ..., 90: ...} per-block opt-in maximum
    assert_fits(result, arch)       # no spills (local or stack), shared memory in bounds

``kernel`` is a module-level ``@triton.jit`` function (it is looked up again by
module and name, see below). ``signature`` maps every non-constexpr argument
name to its Triton type string: ``"*bf16"``, ``"*fp16"``, ``"*fp32"``,
``"*i64"``, ``"*i32"`` (pointers), ``"i32"``, ``"i64"``, ``"fp32"`` (scalars).
``constexprs`` maps the ``tl.constexpr`` argument names to their values (they
need not appear in ``signature``). An argument in neither, or a name that is
not an argument, is a ``ValueError`` naming it. Pointer arguments are marked
16-byte aligned, as the Triton runtime marks freshly allocated tensors;
``divisible_by_16`` names integer arguments to mark likewise.

The returned dict holds ``ptx`` (str), ``registers`` (per thread),
``local_bytes`` (per-thread local memory: register spills and local arrays),
``spill_bytes`` (the same number: ptxas puts spills in local memory),
``stack_bytes``, ``shared_bytes`` (Triton's dynamic shared memory plus any
static), ``name`` and ``arch``.

Interpreter note: with ``TRITON_INTERPRET=1`` (how the CPU suite runs),
``@triton.jit`` yields interpreter objects, down to ``tl.rand`` and every
helper a kernel calls, and those cannot be compiled. So when the interpreter is
on, compiling happens in long-lived worker processes started with the
interpreter off (spawned lazily, reused by every call); the kernel is
re-imported there from ``kernel.fn.__module__`` by name, so it must be a
module-level attribute of an importable module. Without the interpreter it
compiles in-process.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import os
import pickle
import re
import shutil
import struct
import subprocess
import sys
import tempfile
from typing import Dict, Iterable, List, Optional, Sequence

# Maximum shared memory one block may opt into: 227 KiB on sm_90 (H100/H200),
# 163 KiB on sm_80 (A100).
SHARED_MEMORY_LIMIT_BYTES = {80: 163 * 1024, 86: 99 * 1024, 89: 99 * 1024, 90: 227 * 1024}

__all__ = ["compile_for_gpu", "compile_many_for_gpu", "gpu_compile_unavailable_reason", "require_gpu_compiler",
           "SHARED_MEMORY_LIMIT_BYTES"]


def _nvidia_bin(tool: str) -> Optional[str]:
    try:
        import triton.backends.nvidia as nv
    except Exception:
        return None
    path = os.path.join(os.path.dirname(nv.__file__), "bin", tool)
    if os.path.exists(path):
        return path
    return shutil.which(tool)


@functools.lru_cache(maxsize=None)
def gpu_compile_unavailable_reason() -> Optional[str]:
    """None when NVIDIA compilation works here, else a sentence saying why not (cached)."""
    try:
        import triton  # noqa: F401
        import triton.compiler  # noqa: F401
        from triton.backends.compiler import GPUTarget  # noqa: F401
    except Exception as exc:  # pragma: no cover - depends on the install
        return f"triton does not import: {exc!r}"
    if _nvidia_bin("cuobjdump") is None:
        return "cuobjdump not found in triton's wheel (triton/backends/nvidia/bin) nor on PATH"
    try:
        _run(_probe_in_this_process)
    except Exception as exc:
        return f"the NVIDIA backend of triton cannot compile here: {type(exc).__name__}: {exc}"
    return None


def _probe_in_this_process() -> None:
    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget

    @triton.jit
    def _probe(x_ptr, BLOCK: tl.constexpr):
        offs = tl.arange(0, BLOCK)
        tl.store(x_ptr + offs, tl.load(x_ptr + offs) + 1.0)

    src = _ast_source(_probe, {"x_ptr": "*fp32", "BLOCK": "constexpr"}, {"BLOCK": 32}, {})
    compiled = triton.compile(src, target=GPUTarget("cuda", 80, 32), options={"num_warps": 1, "num_stages": 1})
    _resource_usage(compiled.asm["cubin"], "_probe")


def require_gpu_compiler() -> None:
    """Skip the calling test (pytest.skip with the reason) when GPU compilation is impossible here."""
    reason = gpu_compile_unavailable_reason()
    if reason is not None:
        import pytest

        pytest.skip(reason)


def _ast_source(fn, signature: Dict[str, str], constexprs: Dict[str, object], attrs):
    import triton.compiler

    params = inspect.signature(triton.compiler.ASTSource.__init__).parameters
    if "constexprs" in params:  # triton >= 3.2
        return triton.compiler.ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
    return triton.compiler.ASTSource(fn=fn, signature=signature, constants=constexprs, attrs=attrs)  # older


def unaligned_pointers(fn) -> tuple:
    """The kernel's ``do_not_specialize_on_alignment`` (a compiled ``JITFunction``'s attribute, or the jit
    keywords an interpreted function keeps)."""
    names = getattr(fn, "do_not_specialize_on_alignment", None)
    if names is None:
        names = getattr(fn, "kwargs", {}).get("do_not_specialize_on_alignment", ())
    return tuple(names or ())


def _attrs_for(fn, signature: Dict[str, str], divisible: Iterable[str]):
    """``{(arg index,): [["tt.divisibility", 16]]}`` for the pointers and the named ints, as the runtime
    specializes them: a pointer the kernel lists in ``do_not_specialize_on_alignment`` (a device scalar or a
    slice at any offset) never gets the 16-byte hint at run time, so it does not get it here either."""
    wanted = set(divisible)
    unaligned = set(unaligned_pointers(fn))
    attrs = {}
    for i, name in enumerate(fn.arg_names):
        ty = signature.get(name, "constexpr")
        if ty == "constexpr" or (ty.startswith("*") and (name in unaligned or i in unaligned)):
            continue
        if ty.startswith("*") or name in wanted:
            attrs[(i,)] = [["tt.divisibility", 16]]
    return attrs


def _resource_usage(cubin: bytes, name: str) -> Dict[str, int]:
    cuobjdump = _nvidia_bin("cuobjdump")
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "kernel.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        text = subprocess.run([cuobjdump, "--dump-resource-usage", path], check=True, capture_output=True,
                              text=True).stdout
    usage = {}
    for line in text.splitlines():
        if "REG:" in line:
            for key, value in re.findall(r"([A-Z_]+(?:\[\d+\])?):(\d+)", line):
                usage[key] = int(value)
            break
    if "REG" not in usage:
        raise RuntimeError(f"could not read the resource usage of {name} from cuobjdump:\n{text}")
    return usage


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


class _CompileWorker:
    """A child Python process (interpreter off) that runs pickled ``(fn, args)`` calls one at a time.

    Requests and replies are length-prefixed pickles over a private pipe pair;
    the child's fd 1 is pointed at its stderr so that nothing printed by
    Triton or ptxas can corrupt the protocol. Plain ``subprocess`` rather than
    ``multiprocessing`` so that the caller's ``__main__`` is never re-imported.
    """

    def __init__(self):
        env = dict(os.environ)
        env.pop("TRITON_INTERPRET", None)
        paths = [p for p in sys.path if p]
        here = os.path.dirname(os.path.abspath(__file__))
        code = (f"import sys; sys.path[:0] = {[here] + paths!r}; "
                f"import {__name__} as m; m._serve()")
        self.proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     env=env)

    def call(self, fn, *args):
        payload = pickle.dumps((fn, args))
        self.proc.stdin.write(struct.pack("<Q", len(payload)) + payload)
        self.proc.stdin.flush()
        header = self.proc.stdout.read(8)
        if len(header) < 8:
            raise RuntimeError(f"the GPU-compile worker process died (exit code {self.proc.poll()})")
        (size,) = struct.unpack("<Q", header)
        ok, value = pickle.loads(self.proc.stdout.read(size))
        if not ok:
            raise value
        return value


def _serve() -> None:
    """Worker loop of :class:`_CompileWorker` (runs in the child)."""
    reply = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    requests = sys.stdin.buffer
    while True:
        header = requests.read(8)
        if len(header) < 8:
            return
        (size,) = struct.unpack("<Q", header)
        fn, args = pickle.loads(requests.read(size))
        try:
            result = (True, fn(*args))
        except Exception as exc:  # sent back and re-raised in the caller
            try:
                pickle.dumps(exc)
                result = (False, exc)
            except Exception:
                result = (False, RuntimeError(f"{type(exc).__name__}: {exc}"))
        payload = pickle.dumps(result)
        reply.write(struct.pack("<Q", len(payload)) + payload)
        reply.flush()


_workers: List[_CompileWorker] = []


def _live_workers(count: int) -> List[_CompileWorker]:
    _workers[:] = [w for w in _workers if w.proc.poll() is None]
    while len(_workers) < count:
        _workers.append(_CompileWorker())
    return _workers[:count]


def _run(fn, *args):
    """Run ``fn(*args)`` where ``@triton.jit`` compiles for real: here, or in a worker process."""
    if not _interpreting():
        return fn(*args)
    return _live_workers(1)[0].call(fn, *args)


def _kernel_location(kernel):
    py_fn = getattr(kernel, "fn", None)
    if py_fn is None or not hasattr(kernel, "arg_names"):
        raise TypeError(f"compile_for_gpu needs a @triton.jit kernel, got {type(kernel).__name__}")
    module, name = py_fn.__module__, py_fn.__name__
    found = getattr(importlib.import_module(module), name, None)
    if found is not kernel:
        raise ValueError(f"compile_for_gpu needs a module-level @triton.jit kernel; {module}.{name} is not one")
    return module, name


def _compile_in_this_process(module: str, name: str, signature: Dict[str, str], constexprs: Dict[str, object],
                             arch: int, num_warps: int, num_stages: int, divisible: tuple,
                             maxnreg: Optional[int] = None) -> dict:
    import triton
    from triton.backends.compiler import GPUTarget

    fn = getattr(importlib.import_module(module), name)
    full_sig, missing = {}, []
    for arg in fn.arg_names:
        if arg in constexprs:
            full_sig[arg] = "constexpr"
        elif arg in signature:
            full_sig[arg] = signature[arg]
        else:
            missing.append(arg)
    if missing:
        raise ValueError(f"{name}: arguments {missing} are in neither signature nor constexprs")
    unknown = sorted((set(signature) | set(constexprs)) - set(fn.arg_names))
    if unknown:
        raise ValueError(f"{name}: {unknown} are not arguments of the kernel (it has {fn.arg_names})")
    src = _ast_source(fn, full_sig, dict(constexprs), _attrs_for(fn, full_sig, divisible))
    options = {"num_warps": num_warps, "num_stages": num_stages}
    if maxnreg is not None:
        options["maxnreg"] = int(maxnreg)
    compiled = triton.compile(src, target=GPUTarget("cuda", arch, 32), options=options)
    usage = _resource_usage(compiled.asm["cubin"], name)
    local = usage.get("LOCAL", 0)
    return {
        "name": name,
        "arch": arch,
        "ptx": compiled.asm["ptx"],
        "registers": usage["REG"],
        "local_bytes": local,
        "spill_bytes": local,
        "stack_bytes": usage.get("STACK", 0),
        "shared_bytes": int(getattr(compiled.metadata, "shared", 0) or 0) + usage.get("SHARED", 0),
    }


def compile_for_gpu(kernel, signature: Dict[str, str], constexprs: Dict[str, object], arch: int = 90,
                    num_warps: int = 4, num_stages: int = 3, *, divisible_by_16: Iterable[str] = (),
                    maxnreg: Optional[int] = None) -> dict:
    """Compile ``kernel`` for ``sm_{arch}``; returns its PTX and resource usage (see the module doc).

    ``maxnreg``: the launch option of that name (the register cap the launcher passes), if any.
    """
    module, name = _kernel_location(kernel)
    return _run(_compile_in_this_process, module, name, dict(signature), dict(constexprs), int(arch),
                int(num_warps), int(num_stages), tuple(divisible_by_16), maxnreg)


def compile_many_for_gpu(jobs: Sequence[dict], workers: int = 2) -> list:
    """Compile several kernels, ``workers`` at a time when the interpreter is on (else one by one).

    Each job is a dict of :func:`compile_for_gpu`'s arguments (``kernel``,
    ``signature``, ``constexprs`` and optionally ``arch``, ``num_warps``,
    ``num_stages``, ``divisible_by_16``). Returns one entry per job, in order:
    the result dict, or the exception that job raised (not re-raised, so one
    bad kernel does not hide the others).
    """
    calls = []
    for job in jobs:
        module, name = _kernel_location(job["kernel"])
        calls.append((module, name, dict(job["signature"]), dict(job["constexprs"]), int(job.get("arch", 90)),
                      int(job.get("num_warps", 4)), int(job.get("num_stages", 3)),
                      tuple(job.get("divisible_by_16", ())), job.get("maxnreg")))
    results: list = [None] * len(calls)
    if not _interpreting() or workers <= 1 or len(calls) <= 1:
        for i, args in enumerate(calls):
            try:
                results[i] = _run(_compile_in_this_process, *args)
            except Exception as exc:
                results[i] = exc
        return results
    import queue
    import threading

    pending: "queue.Queue[int]" = queue.Queue()
    for i in range(len(calls)):
        pending.put(i)

    def drain(worker: _CompileWorker) -> None:
        while True:
            try:
                i = pending.get_nowait()
            except queue.Empty:
                return
            try:
                results[i] = worker.call(_compile_in_this_process, *calls[i])
            except Exception as exc:
                results[i] = exc

    threads = [threading.Thread(target=drain, args=(w,)) for w in _live_workers(min(workers, len(calls)))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def assert_fits(result: dict, arch: int, name: Optional[str] = None) -> None:
    """No spills (ptxas 13 reports them as a stack frame, older ones as local memory: both must be 0) and
    shared memory within ``sm_{arch}``'s per-block limit. Every compile test holds its kernels to this."""
    name = name or result["name"]
    local = result.get("local_bytes", result.get("spill_bytes", 0))
    assert local == 0, f"{name} on sm_{arch} uses {local} B of local memory (spills)"
    assert result["stack_bytes"] == 0, f"{name} on sm_{arch} has a {result['stack_bytes']} B stack frame (spills)"
    assert result["shared_bytes"] <= SHARED_MEMORY_LIMIT_BYTES[arch], (
        f"{name} on sm_{arch} needs {result['shared_bytes']} B of shared memory, limit {SHARED_MEMORY_LIMIT_BYTES[arch]}")
