"""The C++ extension builds and loads; ``setup.py`` builds one host-code extension, in parallel."""

import os
import threading
import time

import dflash_kernels._C as C

SETUP = os.path.join(os.path.dirname(__file__), "..", "..", "setup.py")


def _setup_namespace():
    """``setup.py`` executed up to (not including) its ``setup(...)`` call."""
    src = open(SETUP).read().split("\nsetup(")[0]
    ns = {"__file__": SETUP}
    exec(compile(src, SETUP, "exec"), ns)
    return ns


def test_extension_loads_and_has_the_tree_ops():
    for name in ("build_tree", "walk_tree"):
        assert callable(getattr(C, name)), name


def test_setup_builds_cpp_sources_only():
    ext = _setup_namespace()["extension"]()
    assert ext.sources and all(s.endswith(".cpp") for s in ext.sources)
    assert not any(p.endswith(".cu") for p in os.listdir(os.path.join(os.path.dirname(SETUP), "csrc")))


class _RecordingCompiler:
    """The ``CCompiler`` surface the parallel compile uses; ``_compile`` sleeps and records overlap."""

    def __init__(self):
        self.compiled, self.active, self.peak = [], 0, 0
        self.lock = threading.Lock()

    def _setup_compile(self, output_dir, macros, include_dirs, sources, depends, extra_postargs):
        objects = [s.replace(".cpp", ".o") for s in sources]
        build = {o: (s, ".cpp") for o, s in zip(objects, sources) if "uptodate" not in s}
        return macros, objects, extra_postargs, [], build

    def _get_cc_args(self, pp_opts, debug, extra_preargs):
        return ["-c"]

    def _compile(self, obj, src, ext, cc_args, extra_postargs, pp_opts):
        with self.lock:
            self.active += 1
            self.peak = max(self.peak, self.active)
        time.sleep(0.05)
        with self.lock:
            self.active -= 1
            self.compiled.append(src)


def test_parallel_compile_runs_every_out_of_date_source_concurrently(monkeypatch):
    monkeypatch.setenv("MAX_JOBS", "3")
    ns = _setup_namespace()
    compiler = _RecordingCompiler()
    compile_all = ns["BuildExtension"]._parallel_compile(compiler)
    sources = ["a.cpp", "b.cpp", "c.cpp", "uptodate.cpp"]
    objects = compile_all(sources, output_dir="build")
    assert objects == ["a.o", "b.o", "c.o", "uptodate.o"]  # every object, as the serial compile returns
    assert sorted(compiler.compiled) == ["a.cpp", "b.cpp", "c.cpp"]  # an up-to-date one is not rebuilt
    assert compiler.peak > 1


def test_parallel_jobs_reads_max_jobs(monkeypatch):
    ns = _setup_namespace()
    monkeypatch.setenv("MAX_JOBS", "5")
    assert ns["parallel_jobs"]() == 5
    monkeypatch.delenv("MAX_JOBS")
    assert ns["parallel_jobs"]() >= 1


def test_setup_leaves_the_cxx_standard_to_torch():
    """torch 2.14's headers need C++20 and torch's build adds the standard its headers need unless a -std flag
    is given, so a pinned -std=c++17 breaks the build on torch 2.14."""
    ext = _setup_namespace()["extension"]()
    flags = ext.extra_compile_args["cxx"] if isinstance(ext.extra_compile_args, dict) else ext.extra_compile_args
    assert not any(flag.startswith("-std=") for flag in flags)
