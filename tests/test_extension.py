"""The C++ extension builds and loads; its build flavour matches the machine."""

import torch

import dflash_kernels._C as C


def test_extension_loads_with_matching_flavour():
    # CPU-only torch builds must produce the CppExtension flavour.
    if torch.version.cuda is None:
        assert C.built_with_cuda is False
    assert isinstance(C.built_with_cuda, bool)


def test_setup_chooses_cpp_extension_without_cuda(monkeypatch):
    import importlib.util
    import os

    monkeypatch.setenv("DFLASH_FORCE_CPU", "1")
    spec = importlib.util.spec_from_file_location(
        "dflash_setup_probe", os.path.join(os.path.dirname(__file__), "..", "setup.py")
    )
    # Reading the chooser without running setup(): exec only the helper.
    src = open(spec.origin).read().split("\nsetup(")[0]
    ns = {"__file__": spec.origin}
    exec(compile(src, spec.origin, "exec"), ns)
    assert ns["cuda_build_wanted"]() is False
    ext = ns["extension"]()
    assert not any(s.endswith(".cu") for s in ext.sources)
    monkeypatch.setenv("DFLASH_FORCE_CPU", "0")
    monkeypatch.setenv("DFLASH_FORCE_CUDA", "1")
    assert ns["cuda_build_wanted"]() is True
