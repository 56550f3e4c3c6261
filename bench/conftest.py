"""Shared setup of the microbenchmark suite (``python -m pytest bench ...``).

* Collects ``bench/bench_*.py`` (pytest's default pattern is ``test_*.py``),
  so ``python -m pytest bench`` runs every per-op benchmark file.
* Without CUDA, switches Triton's CPU interpreter on before anything imports
  triton, exactly as each bench file does on its own: the interpreter is a
  correctness tool, not a speed path, so on a CPU machine the Triton
  providers run one round and their times mean nothing; the pure-torch
  providers are real CPU timings. Every result records
  ``extra_info["triton_interpreter"]`` so a JSON reader can tell.
* Records the peak memory of every benchmark test in ``extra_info``:
  ``peak_cuda_mib`` (``torch.cuda.max_memory_allocated`` over the whole test,
  absolute) on a GPU, ``peak_rss_growth_mib`` (growth of the process's peak
  resident set over the whole test, inputs included, via ``VmHWM`` of
  ``/proc/self/status`` after a reset through ``/proc/self/clear_refs``) on a
  CPU. Bench files that measure their own provider's extra memory keep their
  own keys (``peak_extra_mib``).
* Adds torch / triton / transformers versions, the GPU name and the kernel
  backend to the JSON's ``machine_info``, and creates the directory of
  ``--benchmark-json PATH`` when it does not exist.

The JSON written by ``--benchmark-json`` is pytest-benchmark's own format:
``pytest-benchmark compare bench/results/micro.json`` reads it.
"""

import os

import torch

if not torch.cuda.is_available():  # before any bench module or dflash_kernels imports triton
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402


def pytest_collect_file(file_path, parent):
    """Collect ``bench_*.py`` files as test modules (explicitly named files are collected by pytest itself)."""
    if file_path.suffix == ".py" and file_path.name.startswith("bench_") and not parent.session.isinitpath(file_path):
        return pytest.Module.from_parent(parent, path=file_path)
    return None


def pytest_configure(config):
    path = config.getoption("benchmark_json", default=None)
    if path:
        os.makedirs(os.path.dirname(os.path.abspath(str(path))), exist_ok=True)


def pytest_benchmark_update_machine_info(config, machine_info):
    import dflash_kernels

    try:
        import triton

        triton_version = triton.__version__
    except Exception:  # pragma: no cover - depends on the install
        triton_version = None
    try:
        import transformers

        transformers_version = transformers.__version__
    except Exception:  # pragma: no cover
        transformers_version = None
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    machine_info["dflash"] = dict(
        torch=torch.__version__, triton=triton_version, transformers=transformers_version,
        cuda_device=torch.cuda.get_device_name(0) if device.type == "cuda" else None,
        kernel_backend=dflash_kernels.get_backend(device),
        triton_interpreter=os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"),
        torch_threads=torch.get_num_threads(),
    )


from dflash.benchmark.memory import proc_status_kib as _proc_status_kib  # noqa: E402
from dflash.benchmark.memory import reset_peak_rss as _reset_peak_rss  # noqa: E402


@pytest.fixture(autouse=True)
def _record_peak_memory(request):
    """Peak memory of each benchmark test into its ``extra_info`` (see the module docstring)."""
    if "benchmark" not in request.fixturenames:
        yield
        return
    benchmark = request.getfixturevalue("benchmark")
    cuda = torch.cuda.is_available()
    rss_base = None
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    elif _reset_peak_rss():
        rss_base = _proc_status_kib("VmRSS")
    yield
    info = benchmark.extra_info
    info.setdefault("triton_interpreter", os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"))
    if cuda:
        torch.cuda.synchronize()
        info.setdefault("peak_cuda_mib", round(torch.cuda.max_memory_allocated() / 2**20, 2))
    elif rss_base is not None:
        hwm = _proc_status_kib("VmHWM")
        if hwm is not None:
            info.setdefault("peak_rss_growth_mib", round(max(0, hwm - rss_base) / 1024, 2))
