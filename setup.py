"""Build script: compiles ``dflash_kernels._C`` from ``csrc/``.

The extension is a ``CUDAExtension`` when a CUDA toolkit and a CUDA build of
torch with a visible GPU are present (or ``DFLASH_FORCE_CUDA=1``), and a
``CppExtension`` otherwise, so ``pip install`` works on a CPU-only machine.
``DFLASH_FORCE_CPU=1`` forces the C++-only build.
"""

import glob
import os

from setuptools import setup

import torch
from torch.utils import cpp_extension

HERE = os.path.dirname(os.path.abspath(__file__))


def cuda_build_wanted() -> bool:
    """True when the CUDA sources should be compiled with nvcc."""
    if os.environ.get("DFLASH_FORCE_CPU") == "1":
        return False
    if os.environ.get("DFLASH_FORCE_CUDA") == "1":
        return True
    return (
        torch.version.cuda is not None
        and cpp_extension.CUDA_HOME is not None
        and torch.cuda.is_available()
    )


def extension():
    cpp_sources = sorted(glob.glob(os.path.join("csrc", "*.cpp")))
    cxx_flags = ["-O3", "-std=c++17"]
    if cuda_build_wanted():
        cu_sources = sorted(glob.glob(os.path.join("csrc", "*.cu")))
        return cpp_extension.CUDAExtension(
            name="dflash_kernels._C",
            sources=cpp_sources + cu_sources,
            define_macros=[("DFLASH_WITH_CUDA", "1")],
            extra_compile_args={"cxx": cxx_flags, "nvcc": ["-O3", "-std=c++17", "--use_fast_math"]},
        )
    return cpp_extension.CppExtension(
        name="dflash_kernels._C",
        sources=cpp_sources,
        extra_compile_args={"cxx": cxx_flags},
    )


setup(
    ext_modules=[extension()],
    cmdclass={"build_ext": cpp_extension.BuildExtension.with_options(use_ninja=False)},
)
