"""Build script: compiles ``dflash_kernels._C`` from ``csrc/``.

The extension is host code only (the C++ tree build and walk, the cache-row
write), so it is one ``CppExtension`` on every machine: a CPU-only machine and
a GPU machine build the same thing, and no nvcc compile runs (the GPU work is
Triton's). Sources compile in parallel: with ninja when it is installed
(torch's build), else with a thread per source (``MAX_JOBS`` caps both, as
torch's ninja build reads it).
"""

import glob
import os
from concurrent.futures import ThreadPoolExecutor

from setuptools import setup

from torch.utils import cpp_extension


def parallel_jobs() -> int:
    """``MAX_JOBS`` when set, else the CPU count (at least 1)."""
    value = os.environ.get("MAX_JOBS", "")
    return max(1, int(value)) if value.isdigit() else max(1, os.cpu_count() or 1)


class BuildExtension(cpp_extension.BuildExtension):
    """torch's build (ninja when available); without ninja, every source compiles on its own thread."""

    def build_extensions(self) -> None:
        if not self.use_ninja:
            self.compiler.compile = self._parallel_compile(self.compiler)
        super().build_extensions()

    @staticmethod
    def _parallel_compile(compiler):
        """A ``CCompiler.compile`` that runs its per-object ``_compile`` calls on ``parallel_jobs()`` threads.

        The same steps as the serial loop (set-up, the cc arguments, one ``_compile`` per out-of-date
        object): each ``_compile`` spawns its own compiler process, so threads suffice."""

        def compile(sources, output_dir=None, macros=None, include_dirs=None, debug=0, extra_preargs=None,
                    extra_postargs=None, depends=None):
            macros, objects, extra_postargs, pp_opts, build = compiler._setup_compile(
                output_dir, macros, include_dirs, sources, depends, extra_postargs)
            cc_args = compiler._get_cc_args(pp_opts, debug, extra_preargs)
            todo = [(obj, build[obj]) for obj in objects if obj in build]

            def one(item):
                obj, (src, ext) = item
                compiler._compile(obj, src, ext, cc_args, extra_postargs, pp_opts)

            with ThreadPoolExecutor(max_workers=min(parallel_jobs(), max(1, len(todo)))) as pool:
                list(pool.map(one, todo))
            return objects

        return compile


def extension():
    return cpp_extension.CppExtension(
        name="dflash_kernels._C",
        sources=sorted(glob.glob(os.path.join("csrc", "*.cpp"))),
        # no -std flag: torch adds the standard its headers need (C++17 up to torch 2.13, C++20 from 2.14)
        extra_compile_args={"cxx": ["-O3"]},
    )


setup(
    ext_modules=[extension()],
    cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)},
)
