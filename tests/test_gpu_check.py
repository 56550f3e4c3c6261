"""The one-shot GPU check on a CPU machine: syntax, the early failure without a GPU, and its Python parts at tiny shapes.

``bench/gpu_check.sh`` must stop before building anything, with a non-zero
status and a message saying what is missing. ``bench/gpu_kernel_check.py``,
``bench/gpu_round_latency.py`` and ``bench/gpu_family_check.py`` run here at
tiny shapes (``--device cpu --tiny``), and must fail when a result is wrong.
"""

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import dflash_kernels

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "bench" / "gpu_check.sh"


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny shapes run fastest on one thread (and the CI machine's cores are shared); restored after."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def load_script(name):
    spec = importlib.util.spec_from_file_location(f"bench_{name}", ROOT / "bench" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the file executes
    spec.loader.exec_module(module)
    return module


def run_check(path_dirs, tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("OUT", "PATH")}
    env.update(PATH=os.pathsep.join(path_dirs), PYTHON=sys.executable, OUT=str(tmp_path / "out"))
    return subprocess.run(["bash", str(SCRIPT)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)


def system_path_without_nvidia_smi():
    """PATH entries that hold no nvidia-smi (bash, grep, timeout stay reachable)."""
    dirs = [d for d in os.environ.get("PATH", "").split(os.pathsep) if d and not (Path(d) / "nvidia-smi").exists()]
    return dirs or ["/usr/bin", "/bin"]


def test_script_is_valid_bash():
    result = subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_no_gpu_fails_early_and_loudly(tmp_path):
    result = run_check(system_path_without_nvidia_smi(), tmp_path)
    assert result.returncode == 1
    assert "gpu_check: FAIL: no NVIDIA GPU visible: nvidia-smi is not on PATH" in result.stderr
    assert "== [build]" not in result.stdout  # stopped before installing anything
    assert not (tmp_path / "out").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a usable GPU")
def test_gpu_listed_but_torch_without_cuda_fails_early(tmp_path):
    fake_bin = tmp_path / "bin"
    fake_bin.mkdir()
    smi = fake_bin / "nvidia-smi"
    smi.write_text('#!/bin/sh\necho "GPU 0: Fake GPU (UUID: GPU-00000000)"\n')
    smi.chmod(0o755)
    result = run_check([str(fake_bin)] + system_path_without_nvidia_smi(), tmp_path)
    assert result.returncode == 1
    assert "nvidia-smi sees 1 GPU(s) but torch.cuda.is_available() is False" in result.stderr
    assert "== [build]" not in result.stdout


FAKE_PYTHON = """#!/bin/sh
case "$*" in
  *"import torch"*) echo "9.0|Fake GPU";;
  *"%s"*) echo "simulated failure"; exit 3;;
  *) echo "fake python: $*";;
esac
"""


def run_with_fake_gpu(tmp_path, failing="no-such-step", budget=None):
    """The script with a fake nvidia-smi and a fake python that passes every step except ``failing``."""
    fake_bin = tmp_path / "bin"
    fake_bin.mkdir()
    (fake_bin / "nvidia-smi").write_text('#!/bin/sh\necho "GPU 0: Fake GPU (UUID: GPU-00000000)"\n')
    (fake_bin / "python").write_text(FAKE_PYTHON % failing)
    for f in fake_bin.iterdir():
        f.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k not in ("OUT", "PATH", "GPU_CHECK_BUDGET_S")}
    env.update(PATH=os.pathsep.join([str(fake_bin)] + system_path_without_nvidia_smi()),
               PYTHON=str(fake_bin / "python"), OUT=str(tmp_path / "out"))
    if budget is not None:
        env["GPU_CHECK_BUDGET_S"] = str(budget)
    return subprocess.run(["bash", str(SCRIPT)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)


STEPS = ["build", "cuda-ext", "tests", "kernels", "compiled", "hybrid", "micro", "round", "syncs", "stress", "families", "e2e"]


def summary_states(stdout):
    lines = stdout.split("== gpu_check summary")[1].splitlines()[2:]
    return {line.split()[0]: " ".join(line.split()[1:-1]) for line in lines if line.split() and line.split()[0] in STEPS}


def test_step_runner_all_steps_pass(tmp_path):
    result = run_with_fake_gpu(tmp_path)
    assert result.returncode == 0, result.stderr
    assert summary_states(result.stdout) == {step: "ok" for step in STEPS}
    assert "gpu_check: all steps passed" in result.stdout
    assert 'fake python: -m pip install --no-build-isolation --no-deps --no-index -e .' in result.stdout
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == sorted(f"{s}.log" for s in STEPS)


def test_step_runner_a_failing_kernel_check_fails_the_run(tmp_path):
    result = run_with_fake_gpu(tmp_path, failing="gpu_kernel_check.py")
    assert result.returncode == 1
    states = summary_states(result.stdout)
    assert states["kernels"] == "FAIL (3)" and states["round"] == "ok"  # the other steps still run
    assert "== [kernels] FAILED (exit 3)" in result.stderr and "gpu_check: FAIL" in result.stderr


def test_step_runner_stops_when_the_build_fails(tmp_path):
    result = run_with_fake_gpu(tmp_path, failing="pip install")
    assert result.returncode == 1
    assert list(summary_states(result.stdout)) == ["build"]
    assert "the extension did not build" in result.stderr


def test_step_runner_respects_the_time_budget(tmp_path):
    result = run_with_fake_gpu(tmp_path, budget=5)
    assert result.returncode == 1
    assert summary_states(result.stdout) == {"build": "no time"}


@pytest.mark.skipif(shutil.which("timeout") is None, reason="coreutils timeout is missing")
def test_script_installs_offline_for_this_gpu_within_the_budget():
    text = SCRIPT.read_text()
    # the install must not reach for the network, and the build must target this GPU only
    assert "--no-build-isolation --no-deps --no-index -e ." in text
    assert 'TORCH_CUDA_ARCH_LIST="$ARCH"' in text
    assert "GPU_CHECK_BUDGET_S:-560" in text  # 560 s < 10 minutes (one device call), whatever each step takes
    for script in ("gpu_round_syncs.py", "gpu_compaction_stress.py", "gpu_round_latency.py", "gpu_family_check.py",
                   "gpu_compiled_round.py", "gpu_hybrid_check.py"):
        assert f"bench/{script}" in text


# ------------------------------------------------------------ Python parts
def interpreter_available():
    return "triton" in dflash_kernels.available_backends(torch.device("cpu"))


@pytest.mark.skipif(not interpreter_available(), reason="needs the Triton interpreter on CPU tensors")
def test_kernel_check_passes_at_tiny_shapes(tmp_path, capsys):
    check = load_script("gpu_kernel_check")
    out = tmp_path / "kernels.json"
    assert check.main(["--device", "cpu", "--tiny", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    names = {r["check"].split()[0] for r in report["checks"]}
    assert {"gather_concat", "lm_head_logits", "lm_head_argmax", "lm_head_topk", "lm_head_sample",
            "lm_head_cross_entropy", "build_tree", "walk_tree", "tree_positions", "ancestor_bits",
            "tree_attention_mask", "tree_attention", "compact_kv_"} == names
    assert all(r["ok"] for r in report["checks"])
    assert report["ratios"]["gather_prefill"]["fraction_of_copy_bandwidth"] > 0
    assert report["ratios"]["tree_attention"]["speedup_over_sdpa_dense_mask"] > 0
    assert "of copy bandwidth" in capsys.readouterr().out


@pytest.mark.skipif(not interpreter_available(), reason="needs the Triton interpreter on CPU tensors")
def test_kernel_check_fails_on_a_wrong_kernel_result(monkeypatch, capsys):
    check = load_script("gpu_kernel_check")
    real = dflash_kernels.gather_concat

    def off_by_one_row(layers, rows=None, out=None, **kw):
        result = real(layers, rows=rows, out=out, **kw)
        result[-1, 0] += 1
        return result

    monkeypatch.setattr(dflash_kernels, "gather_concat", off_by_one_row)
    assert check.main(["--device", "cpu", "--tiny", "--only", "gather"]) == 1
    captured = capsys.readouterr()
    assert "FAIL  gather_concat prefill rows" in captured.out
    assert "differ from the reference" in captured.err


def test_round_latency_runs_at_tiny_shapes_and_paths_agree(tmp_path, capsys):
    latency = load_script("gpu_round_latency")
    out = tmp_path / "round.json"
    with dflash_kernels.force_backend("reference"):
        assert latency.main(["--device", "cpu", "--tiny", "--repeats", "1", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert [r["scenario"] for r in report["rows"]] == ["dflash chain B=8", "ddtree budget 8", "ddtree budget 16"]
    for row in report["rows"]:
        assert row["choices_agree"] == 1.0
        assert row["feature_rel_err"] < 1e-4 and row["kv_rel_err"] < 1e-4
        assert row["ours_ms"] > 0 and row["plain_ms"] > 0 and row["dense_ms"] > 0
        assert row["accepted_rows"] >= 2
    assert "target cut to 6 of 6 decoder layers" in capsys.readouterr().out


def test_round_latency_fails_when_compaction_is_skipped(monkeypatch, capsys):
    from dflash.target.cache import TargetKVCache

    latency = load_script("gpu_round_latency")
    monkeypatch.setattr(TargetKVCache, "compact_rows", lambda self, rows, num_rows: None)
    with dflash_kernels.force_backend("reference"):
        rc = latency.main(["--device", "cpu", "--tiny", "--budgets", "16", "--repeats", "1"])
    assert rc == 1
    assert "ddtree budget 16" in capsys.readouterr().err


def test_dense_tree_mask_matches_the_ancestor_bits():
    latency = load_script("gpu_round_latency")
    parents = torch.tensor([-1, 0, 0, 1, 3, 2, 5, 1])
    mask = latency.dense_tree_mask(parents, 3, torch.float32, max_depth=7)
    want = dflash_kernels.reference.tree_attention_mask(dflash_kernels.reference.ancestor_bits(parents), 3,
                                                        torch.float32)
    assert torch.equal(mask[0, 0] == 0, want == 0)


def test_round_syncs_runs_at_tiny_shapes(tmp_path, capsys):
    syncs = load_script("gpu_round_syncs")
    out = tmp_path / "syncs.json"
    with dflash_kernels.force_backend("reference"):
        assert syncs.main(["--device", "cpu", "--tiny", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert [r["method"] for r in report["rows"]] == ["ar", "dflash", "ddtree"]
    assert all(r["host_reads_max"] == 1 and r["rounds"] >= 3 for r in report["rows"])
    assert "host syncs per round" in capsys.readouterr().out


def test_family_check_runs_at_tiny_shapes(tmp_path, capsys):
    family = load_script("gpu_family_check")
    out = tmp_path / "families.json"
    with dflash_kernels.force_backend("reference"):
        assert family.main(["--device", "cpu", "--tiny", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert {r["stack"] for r in report["rows"]} == {"gpt-oss-20b", "gemma3-12b", "gemma2-9b"}
    assert all(r["ok"] and r["rel_err_logits"] < 1e-4 and r["argmax_agree"] == 1.0 for r in report["rows"])
    assert {r["experts"] for r in report["rows"] if r["stack"] == "gpt-oss-20b"} == {"grouped_mm"}
    assert "every stack matches the model's own forward" in capsys.readouterr().out


@pytest.mark.parametrize("stack,broken", [("gpt-oss-20b", "sinks"), ("gemma2-9b", "softcap")])
def test_family_check_fails_when_a_feature_is_dropped(monkeypatch, capsys, stack, broken):
    """Our attention without the sinks (or the softcap) is caught against the model's own forward."""
    from dflash.target import attention

    real = attention._features
    monkeypatch.setattr(attention, "_features", lambda softcap, sinks: {
        k: v for k, v in real(softcap, sinks).items() if k != broken})
    family = load_script("gpu_family_check")
    with dflash_kernels.force_backend("reference"):
        assert family.main(["--device", "cpu", "--tiny", "--only", stack]) == 1
    assert f"FAIL {stack}" in capsys.readouterr().err


def test_compiled_round_runs_at_tiny_shapes(tmp_path, capsys):
    """The compiled-round GPU script at tiny shapes on the CPU (fixed-shape steps run eagerly): it runs,
    writes its JSON, and finds the two paths' tokens equal."""
    script = load_script("gpu_compiled_round")
    out = tmp_path / "c.json"
    assert script.main(["--device", "cpu", "--tiny", "--mode", "static", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["method"] for r in rows] == ["ar", "dflash", "ddtree"] and all(r["same_tokens"] for r in rows)
    assert "| dflash |" in capsys.readouterr().out
