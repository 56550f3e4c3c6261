"""The one-shot GPU check on a CPU machine: syntax, the plan and its budget, the early failure without a GPU,
the dry run, and its Python parts at tiny shapes.

``bench/gpu_check.sh`` must stop before building anything, with a non-zero
status and a message saying what is missing. Its plan (``PLAN``) must fit its
540 s budget. ``GPU_CHECK_DRY_RUN=1`` must run every step's Python on this
machine's stack (the floor stack in CI: the GPU machine's versions) and exit 0.
``bench/gpu_kernel_check.py``, ``bench/gpu_round_latency.py`` and
``bench/gpu_family_check.py`` run here at tiny shapes (``--device cpu --tiny``),
and must fail when a result is wrong.
"""

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import dflash_kernels

ROOT = Path(__file__).resolve().parents[2]
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


def run_with_fake_gpu(tmp_path, failing="no-such-step", budget=None, steps=None):
    """The script with a fake nvidia-smi and a fake python that passes every step except ``failing``
    (``steps``: GPU_CHECK_STEPS)."""
    fake_bin = tmp_path / "bin"
    fake_bin.mkdir()
    (fake_bin / "nvidia-smi").write_text('#!/bin/sh\necho "GPU 0: Fake GPU (UUID: GPU-00000000)"\n')
    (fake_bin / "python").write_text(FAKE_PYTHON % failing)
    for f in fake_bin.iterdir():
        f.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k not in ("OUT", "PATH") and not k.startswith("GPU_CHECK_")}
    env.update(PATH=os.pathsep.join([str(fake_bin)] + system_path_without_nvidia_smi()),
               PYTHON=str(fake_bin / "python"), OUT=str(tmp_path / "out"))
    if budget is not None:
        env["GPU_CHECK_BUDGET_S"] = str(budget)
    if steps is not None:
        env["GPU_CHECK_STEPS"] = steps
    return subprocess.run(["bash", str(SCRIPT)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)


STEPS = ["build", "kernels", "headline", "tests", "syncs", "round", "long", "compiled", "hybrid", "families", "stress", "e2e", "auto",
         "batch", "micro"]
#: steps that run only when GPU_CHECK_STEPS names them, and where they sit in the plan (before micro)
OPT_IN = ["refloops"]
PLANNED = STEPS[:-1] + OPT_IN + STEPS[-1:]


def summary_states(stdout):
    """step -> state from the printed summary (its rows end in three numbers: seconds, limit, granted)."""
    lines = stdout.split("== gpu_check summary")[1].splitlines()[2:]
    return {line.split()[0]: " ".join(line.split()[1:-3]) for line in lines if line.split() and line.split()[0] in STEPS}


def test_step_runner_all_steps_pass(tmp_path):
    result = run_with_fake_gpu(tmp_path)
    assert result.returncode == 0, result.stderr
    assert summary_states(result.stdout) == {step: "ok" for step in STEPS}
    assert "gpu_check: all steps passed" in result.stdout
    assert 'fake python: -m pip install --no-build-isolation --no-deps --no-index -e .' in result.stdout
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == sorted(
        [f"{s}.log" for s in STEPS] + ["build.json", "gpu_check_summary.json"])
    summary = json.loads((tmp_path / "out" / "gpu_check_summary.json").read_text())
    assert summary["done"] and not summary["failed"] and summary["gpu"] == "Fake GPU"
    assert [s["step"] for s in summary["steps"]] == ["probe"] + PLANNED
    assert all(s["state"] == "ok" and s["granted"] >= s["limit"] for s in summary["steps"] if s["step"] in STEPS)
    assert {s["step"]: s["state"] for s in summary["steps"]}["refloops"] == "not selected"
    assert "reference_loops.py" not in result.stdout


def test_step_runner_a_failing_kernel_check_fails_the_run(tmp_path):
    result = run_with_fake_gpu(tmp_path, failing="gpu_kernel_check.py")
    assert result.returncode == 1
    states = summary_states(result.stdout)
    assert states["kernels"] == "FAIL (3)" and states["round"] == "ok"  # the other steps still run
    assert "== [kernels] FAILED (exit 3)" in result.stderr and "gpu_check: FAIL" in result.stderr
    summary = json.loads((tmp_path / "out" / "gpu_check_summary.json").read_text())
    assert summary["failed"] and {s["step"]: s["state"] for s in summary["steps"]}["kernels"] == "FAIL (3)"


def test_step_runner_stops_when_the_build_fails(tmp_path):
    result = run_with_fake_gpu(tmp_path, failing="pip install")
    assert result.returncode == 1
    assert list(summary_states(result.stdout)) == ["build"]
    assert "the extension did not build" in result.stderr


def test_step_runner_respects_the_time_budget(tmp_path):
    result = run_with_fake_gpu(tmp_path, budget=5)
    assert result.returncode == 1
    assert summary_states(result.stdout) == {"build": "no time"}


def test_step_runner_runs_only_the_selected_steps(tmp_path):
    """GPU_CHECK_STEPS: a second, shorter lease runs what is left; the plan sums the selected steps only, the
    extension is not rebuilt (only checked to import), the others are "not selected" and not run."""
    result = run_with_fake_gpu(tmp_path, steps="hybrid,e2e")
    assert result.returncode == 0, result.stderr
    plan = dict(script_plan()[1])
    assert f"planned device time: {plan['probe'] + plan['hybrid'] + plan['e2e']} s" in result.stdout
    states = summary_states(result.stdout)
    assert states["hybrid"] == "ok" and states["e2e"] == "ok"
    assert {s for s, state in states.items() if state == "not selected"} == set(STEPS) - {"hybrid", "e2e"}
    assert "pip install" not in result.stdout and "build not selected: checking that the extension imports" in \
        result.stdout
    assert "bench/gpu_hybrid_check.py" in result.stdout and "bench/gpu_kernel_check.py" not in result.stdout
    summary = json.loads((tmp_path / "out" / "gpu_check_summary.json").read_text())
    assert not summary["failed"] and {s["step"]: s["state"] for s in summary["steps"]}["kernels"] == "not selected"


def test_an_opt_in_step_runs_when_named(tmp_path):
    """refloops needs the references' code carried to the machine: it runs only when GPU_CHECK_STEPS names it,
    on the GPU, with its sources under GPU_CHECK_REF_SRC (default runs/refsrc), and fails without them."""
    result = run_with_fake_gpu(tmp_path, steps="refloops")
    assert result.returncode == 0, result.stderr
    plan = dict(script_plan()[1])
    assert f"planned device time: {plan['probe'] + plan['refloops']} s" in result.stdout
    assert ("fake python: bench/reference_loops.py --device cuda --zlab-src runs/refsrc/zlab --ddtree-src "
            "runs/refsrc/ddtree --repeats 3 --require-references --json") in result.stdout
    assert set(summary_states(result.stdout).values()) == {"not selected"}


def test_headline_runs_right_after_the_kernels_and_alone(tmp_path):
    """headline comes right after kernels (a short lease still gets it), runs alone with GPU_CHECK_STEPS=headline
    (its plan: probe + headline; the extension only checked to import), learns the seconds it has from
    GPU_CHECK_GRANTED_S, looks for the references under GPU_CHECK_REF_SRC, and takes GPU_CHECK_HEADLINE_ARGS."""
    names = [name for name, _ in script_plan()[1]]
    assert names.index("headline") == names.index("kernels") + 1
    text = SCRIPT.read_text()
    assert text.index("step headline ") > text.index("step kernels ") and text.index("step headline ") < text.index(
        "step tests ")
    fake_bin = tmp_path / "bin"
    result = run_with_fake_gpu(tmp_path, steps="headline")
    assert result.returncode == 0, result.stderr
    plan = dict(script_plan()[1])
    assert f"planned device time: {plan['probe'] + plan['headline']} s" in result.stdout
    assert ("fake python: bench/headline.py --ref-src runs/refsrc --json " + str(tmp_path / "out" / "headline.json")
            + " --markdown " + str(tmp_path / "out" / "headline.md")) in result.stdout
    states = summary_states(result.stdout)
    assert states["headline"] == "ok" and {s for s, st in states.items() if st == "not selected"} == set(STEPS) - {
        "headline"}
    assert "build not selected: checking that the extension imports" in result.stdout
    # the full table through GPU_CHECK_HEADLINE_ARGS, and the granted seconds in the environment
    (fake_bin / "python").write_text(FAKE_PYTHON.replace('echo "fake python: $*"',
                                                         'echo "fake python: $* (granted ${GPU_CHECK_GRANTED_S:-none})"')
                                     % "no-such-step")
    env = {k: v for k, v in os.environ.items() if k not in ("OUT", "PATH") and not k.startswith("GPU_CHECK_")}
    env.update(PATH=os.pathsep.join([str(fake_bin)] + system_path_without_nvidia_smi()),
               PYTHON=str(fake_bin / "python"), OUT=str(tmp_path / "out2"), GPU_CHECK_STEPS="headline",
               GPU_CHECK_HEADLINE_ARGS="--full --prompt-lens 4096", GPU_CHECK_REF_SRC="/refs")
    full = subprocess.run(["bash", str(SCRIPT)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert full.returncode == 0, full.stderr
    line = next(x for x in full.stdout.splitlines() if "bench/headline.py" in x and x.startswith("fake python"))
    assert "--ref-src /refs " in line and line.split(" (granted ")[0].endswith("--full --prompt-lens 4096")
    granted = int(line.split(" (granted ")[1].rstrip(")"))
    assert 500 <= granted <= 535  # alone, it gets what the budget leaves after the probe, less the 5 s grace


def test_step_runner_refuses_an_unknown_step(tmp_path):
    result = run_with_fake_gpu(tmp_path, steps="hybrid,speed")
    assert result.returncode == 1
    assert "GPU_CHECK_STEPS names 'speed', which is no step; the steps are: build kernels" in result.stderr
    assert "== [" not in result.stdout


def test_step_runner_without_build_stops_when_the_extension_does_not_import(tmp_path):
    result = run_with_fake_gpu(tmp_path, failing="import dflash_kernels._C", steps="kernels")
    assert result.returncode == 1
    assert "build is not selected and dflash_kernels._C does not import" in result.stderr
    assert "== [kernels]" not in result.stdout


def script_plan():
    """(budget default, [(step, limit)]) as written in the script's BUDGET_S line and PLAN array."""
    text = SCRIPT.read_text()
    budget = int(re.search(r"GPU_CHECK_BUDGET_S:-(\d+)", text).group(1))
    body = re.search(r"^PLAN=\((.*?)^\)", text, re.S | re.M).group(1)
    plan = [(m.group(1), int(m.group(2))) for m in re.finditer(r"^\s*([a-z0-9-]+):(\d+)\s*$", body, re.M)]
    return budget, plan


def test_plan_fits_the_budget_and_names_every_step():
    budget, plan = script_plan()
    assert budget == 540  # 15 minutes of device time in all, 1-2 of them to start the machine: room for a rerun of part
    assert sum(limit for name, limit in plan if name not in OPT_IN) <= budget  # the default selection
    assert all(limit <= budget for name, limit in plan if name in OPT_IN)
    assert [name for name, _ in plan] == ["probe"] + PLANNED
    text = SCRIPT.read_text()
    assert re.search(r'^OPT_IN=" (.*) "', text, re.M).group(1).split() == OPT_IN
    called = re.findall(r"^\s*step ([a-z0-9-]+) ", text, re.M)
    assert sorted(set(called)) == sorted(PLANNED)  # every planned step runs, nothing unplanned does
    assert all(limit > 0 for _, limit in plan)


@pytest.mark.skipif(shutil.which("timeout") is None, reason="coreutils timeout is missing")
def test_script_installs_offline_and_runs_every_gpu_script():
    text = SCRIPT.read_text()
    # the install must not reach for the network; the extension is host C++ only (no CUDA build to check)
    assert "--no-build-isolation --no-deps --no-index -e ." in text
    assert 'MAX_JOBS="$(nproc)"' in text
    assert "PYTHON:-python3" in text
    assert "built_with_cuda" not in text and "cuda_device_count" not in text and "cuda-ext" not in text
    for script in ("gpu_kernel_check.py", "gpu_round_syncs.py", "gpu_compaction_stress.py", "gpu_round_latency.py",
                   "gpu_family_check.py", "gpu_compiled_round.py", "gpu_hybrid_check.py", "gpu_auto_budget.py",
                   "gpu_batch_crossover.py"):
        assert f"bench/{script}" in text


def gpu_test_ids():
    lines = (ROOT / "bench" / "gpu_tests.txt").read_text().splitlines()
    return [line.strip() for line in lines if line.strip() and not line.strip().startswith("#")]


def test_gpu_kernel_tests_are_cuda_tests():
    """Every listed test lives in a file that puts its tensors on CUDA when it is present."""
    ids = gpu_test_ids()
    assert len(ids) == len(set(ids)) and 40 <= len(ids) <= 90  # a short step: one or a few cases per kernel
    for path in {i.split("::")[0] for i in ids}:
        text = (ROOT / path).read_text()
        assert re.search(r'DEVICE = "cuda" if torch.cuda.is_available\(\)', text) or ".cuda()" in text, path


# ------------------------------------------------------------ the dry run, on this machine's stack
def run_dry(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPU_CHECK_") and k not in ("OUT", "PYTHON")}
    env.update(GPU_CHECK_DRY_RUN="1", PYTHON=sys.executable, OUT=str(tmp_path / "out"))
    return subprocess.run(["bash", str(SCRIPT)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("timeout") is None, reason="coreutils timeout is missing")
def test_floor_stack_dry_run_runs_every_step(tmp_path):
    """The floor-stack check: ``GPU_CHECK_DRY_RUN=1 bash bench/gpu_check.sh`` with this interpreter (in CI the
    floor stack, the GPU machine's torch / triton / transformers) runs every step's Python at tiny shapes on the
    CPU, prints the plan within the budget, and writes every step's JSON."""
    result = run_dry(tmp_path)
    out = result.stdout
    assert result.returncode == 0, out[-4000:] + result.stderr[-4000:]
    planned = int(re.search(r"^planned device time: (\d+) s", out, re.M).group(1))
    assert planned <= 540
    plan_text = out.split("gpu_check: plan")[1].split("planned device time")[0]
    plan = dict(re.findall(r"^  ([a-z0-9-]+)\s+(\d+) s$", plan_text, re.M))
    assert list(plan) == ["probe"] + STEPS
    assert sum(int(v) for v in plan.values()) == planned == sum(
        limit for name, limit in script_plan()[1] if name not in OPT_IN)
    assert "dry run: skipping the nvidia-smi" in out and "dry run: skipping the pip build" in out
    assert "dry run: skipped" in out  # the scripts name the CUDA-only parts they leave out
    assert "gpu_check: FAIL" not in out + result.stderr and "] FAILED" not in result.stderr
    assert "TIMEOUT" not in result.stderr and "**FAILURE**" not in out
    assert summary_states(out) == {step: "ok" for step in STEPS}
    summary = json.loads((tmp_path / "out" / "gpu_check_summary.json").read_text())
    assert summary["dry_run"] and summary["done"] and not summary["failed"] and summary["planned_s"] == planned
    for entry in summary["steps"]:
        if entry["step"] == "probe":
            assert entry["state"] == "skipped (dry run)"
            continue
        if entry["step"] in OPT_IN:
            assert entry["state"] == "not selected"
            continue
        assert entry["state"] == "ok" and entry["limit"] == int(plan[entry["step"]]), entry
        path = tmp_path / "out" / entry["json"]
        assert entry["json"] and path.is_file(), entry
        json.loads(path.read_text())
    tests = json.loads((tmp_path / "out" / "gpu_tests.json").read_text())
    assert tests["collect_only"] and tests["exitstatus"] == 0 and len(tests["collected"]) >= len(gpu_test_ids())
    compiled = json.loads((tmp_path / "out" / "gpu_compiled_round.json").read_text())
    assert compiled["complete"] and all(r["same_tokens"] for r in compiled["rows"])


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
def test_head_sweeps_run_every_plan_and_restore_the_shipped_one():
    """The heads' plan sweeps (run on CUDA only by the check) time every plan and leave the shipped tables."""
    from dflash_kernels import lm_head
    check = load_script("gpu_kernel_check")
    hidden, weight = torch.randn(20, 32, dtype=torch.bfloat16), torch.randn(300, 32, dtype=torch.bfloat16)
    timing = dict(repeats=1, inner=1, warmup=False)
    config, programs = lm_head.head_config, lm_head.HEAD_PROGRAMS_PER_SM
    heads = check.sweep_heads(torch, dflash_kernels, hidden, weight, {}, 1.0, torch.device("cpu"), timing)
    topk = check.sweep_topk(torch, dflash_kernels, hidden, weight, {}, 5, 1.0, torch.device("cpu"), timing)
    assert [(w["block_m"], w["block_n"], w["programs_per_sm"]) for w in heads] == list(check.HEAD_SWEEP)
    assert [w["programs_per_sm"] for w in topk] == list(check.TOPK_SWEEP_PROGRAMS)
    assert all(w["topk_gemm_fraction"] > 0 for w in topk)
    assert lm_head.head_config is config and lm_head.HEAD_PROGRAMS_PER_SM == programs


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
    monkeypatch.setattr(TargetKVCache, "compact_advance", lambda self, rows, count: None)
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


def test_family_check_excludes_rows_whose_experts_flip():
    """The MoE rows: each router's choice is recorded per forward, and a row whose experts differ in any layer
    is left out of the error (and counted); a rigged router that flips every row's experts in our forwards fails
    the check on the flip count."""
    family = load_script("gpu_family_check")
    model = family.build(family.TINY["gpt-oss-20b"], torch.float32, torch.device("cpu"))
    recorder = family.RouterRecorder(model)
    ids = torch.arange(1, 11)[None]
    with torch.no_grad(), recorder.record() as a:
        model(ids)
    assert sorted(a) == [0, 1] and a[0].shape == (10, 2)
    b = {layer: t.clone() for layer, t in a.items()}
    b[1][3] = (b[1][3] + 1) % 4  # row 3 takes other experts in layer 1
    b[1][3] = b[1][3].sort().values
    assert family.agreeing_rows(a, range(10), b, range(10)).tolist() == [i != 3 for i in range(10)]
    assert family.agreeing_rows(a, range(10), b, range(10), layers=[0]).all()
    assert family.agreeing_rows(a, [3, 4], b, [3, 4]).tolist() == [False, True]
    recorder.remove()


def test_family_check_fails_when_experts_differ_beyond_near_ties(monkeypatch, capsys):
    """More flipped rows than near-ties explain fail the check (here: every row, as a wrong router would)."""
    family = load_script("gpu_family_check")
    monkeypatch.setattr(family, "agreeing_rows", lambda own, own_rows, ours, ours_rows, layers=None:
                        torch.zeros(len(own_rows), dtype=torch.bool))
    with dflash_kernels.force_backend("reference"):
        assert family.main(["--device", "cpu", "--tiny", "--only", "gpt-oss-20b"]) == 1
    err = capsys.readouterr().err
    assert "FAIL gpt-oss-20b prefill" in err and "24 of 24 rows with other experts" in err


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


def test_auto_budget_runs_at_tiny_shapes(tmp_path, capsys):
    """The auto-budget GPU script at tiny fp32 shapes on the CPU: every row (fixed budgets and auto) equals greedy
    decoding, the JSON carries auto's ratios, the steered drafter is accepted often."""
    script = load_script("gpu_auto_budget")
    out = tmp_path / "a.json"
    assert script.main(["--dry-run", "--budgets", "2,4,8", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert list(report["table"]) == ["ddtree 2", "ddtree 4", "ddtree 8", "ddtree auto"]
    assert all(r["equal_to_greedy"] for r in report["table"].values())
    assert report["table"]["ddtree 8"]["tau"] > 1.5  # the steering works: drafts are accepted
    assert report["auto_over_best"] > 0 and report["best_fixed"] in (2, 4, 8)
    assert "| ddtree auto |" in capsys.readouterr().out


def test_batch_crossover_runs_at_tiny_shapes(tmp_path, capsys):
    """The batch GPU script at tiny fp32 shapes on the CPU: every method at batch 1 and 3, every row equal to greedy
    decoding, the steered drafter accepted, the fastest method named per batch size."""
    script = load_script("gpu_batch_crossover")
    out = tmp_path / "b.json"
    assert script.main(["--dry-run", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert {(r["method"], r["batch_size"]) for r in report["table"]} == {
        (m, b) for m in ("ar", "dflash", "ddtree 4", "ddtree 8") for b in (1, 3)}
    assert all(r["equal_to_greedy"] for r in report["table"])
    assert max(r["tau"] for r in report["table"]) > 1.5
    assert set(report["best"]) == {"1", "3"}
    assert "batch 3: fastest" in capsys.readouterr().out


class LogitTarget(torch.nn.Module):
    """A stand-in target whose next-token logits are fixed (in its dtype): enough for the divergence report."""

    def __init__(self, logits, dtype):
        super().__init__()
        self.lm_head = torch.nn.Linear(1, 1)
        self.fixed = torch.tensor(logits).to(dtype)
        self.dtype = dtype
        self.config = type("Config", (), {"vocab_size": len(logits)})()

    def forward(self, input_ids):
        logits = self.fixed.expand(*input_ids.shape, -1)
        return type("Out", (), {"logits": logits})()


@pytest.mark.parametrize("dtype,logits,near_tie", [
    (torch.bfloat16, [3.0, 3.0 - 2 ** -6, -1.0, 0.5], True),  # one bf16 ulp apart at magnitude 3
    (torch.bfloat16, [3.0, 2.0, -1.0, 0.5], False),  # a clear winner: a real divergence
    (torch.float32, [3.0, 3.0 - 2 ** -20, -1.0, 0.5], False),  # float32: the tokens must be equal
], ids=["bf16-near-tie", "bf16-clear", "fp32"])
def test_compiled_round_accepts_a_divergence_only_at_a_near_tie(dtype, logits, near_tie):
    script = load_script("gpu_compiled_round")
    target = LogitTarget(logits, dtype)
    eager = torch.tensor([[0, 2, 0]])  # a prompt of 2, then the eager path's token 0 (the top-1)
    compiled = torch.tensor([[0, 2, 1]])  # the compiled path's token 1 (the top-2)
    report = script.divergence_report(target, eager, compiled, prompt_len=2, near_tie_ulps=4)
    assert (report["index"], report["new_token"], report["eager_token"], report["compiled_token"]) == (2, 0, 0, 1)
    assert report["top2_margin"] == pytest.approx(logits[0] - logits[1], abs=1e-7)
    assert report["pair_margin"] == pytest.approx(logits[0] - logits[1], abs=1e-7)
    assert report["threshold"] == pytest.approx(4 * torch.finfo(dtype).eps * 2.0)  # magnitude 3: 2**1
    assert report["near_tie"] is near_tie
    assert script.divergence_report(target, eager, eager.clone(), 2, 4) is None
