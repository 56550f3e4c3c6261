"""bench/reference_loops.py (ours against z-lab's DFlash loop and the DDTree reference loop) at smoke size.

The references need their own environment (bench/reference_worker.py runs there), so here only our side
runs, plus the path where a reference environment cannot serve: the benchmark says so and goes on. The
worker is checked statically: it must not import this repository's ``dflash`` (z-lab's package has the
same import name).
"""

from __future__ import annotations

import ast
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

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "bench" / "reference_loops.py"
WORKER = ROOT / "bench" / "reference_worker.py"


def _run(argv, monkeypatch):
    spec = importlib.util.spec_from_file_location("reference_loops", BENCH)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # its dataclass looks its module up there
    spec.loader.exec_module(module)
    threads = torch.get_num_threads()
    try:
        with dflash_kernels.force_backend("reference"):  # not the Triton interpreter conftest.py switches on
            return module.main(argv)
    finally:
        torch.set_num_threads(threads)


def test_dry_run_of_our_side(tmp_path, capsys, monkeypatch):
    """Ours eager DFlash and DDTree: timed, tau, ops per round from the counted pass, greedy tokens equal."""
    out = tmp_path / "r.json"
    assert _run(["--dry-run", "--json", str(out)], monkeypatch) == 0
    report = json.loads(out.read_text())
    rows = {r["name"]: r for r in report["rows"]}
    assert set(rows) == {"ours dflash, eager", "ours ddtree, eager"}
    for row in rows.values():
        assert row["tokens"] == 8 and row["tokens_per_s"] > 0 and row["tau"] >= 1
        assert row["ops_per_round"] > 0
        assert sum(row["by_op_per_round"].values()) == pytest.approx(row["ops_per_round"])
        assert row["greedy_equal"] is True and row["ratio_to_reference"] is None
    assert any("ours only" in n for n in report["notes"])
    printed = capsys.readouterr().out
    assert "| DFlash | ours dflash, eager |" in printed and "NOTE: no --zlab-python" in printed


def test_a_reference_environment_that_cannot_serve_is_reported(tmp_path, monkeypatch):
    """A python without z-lab's package (ours): the worker refuses, the note says why, our side still runs."""
    out = tmp_path / "r.json"
    assert _run(["--dry-run", "--methods", "dflash", "--no-ops", "--zlab-python", sys.executable,
                 "--json", str(out)], monkeypatch) == 0
    report = json.loads(out.read_text())
    assert [r["name"] for r in report["rows"]] == ["ours dflash, eager"]
    assert any("zlab worker could not start" in n for n in report["notes"]), report["notes"]


def _imports(tree):
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, "a relative import in the worker"
            yield node.module
            yield from (f"{node.module}.{a.name}" for a in node.names)


def test_the_worker_imports_nothing_of_this_repository():
    """Its only ``dflash`` imports are z-lab's ``dflash`` / ``dflash.model`` (a module this package does not
    have); nothing of ``dflash_kernels``; it loads the launch counter by path."""
    tree = ast.parse(WORKER.read_text())
    names = set(_imports(tree))
    ours = {n for n in names if n.split(".")[0] in ("dflash", "dflash_kernels")}
    assert ours <= {"dflash", "dflash.model"}, ours
    assert not (ROOT / "dflash" / "model.py").exists() and not (ROOT / "dflash" / "model").exists()
    tops = {n.split(".")[0] for n in names}
    allowed = set(sys.stdlib_module_names) | {"torch", "transformers", "dflash", "ddtree", "model"}
    assert tops <= allowed, tops - allowed
    assert "spec_from_file_location" in WORKER.read_text()


FAKE_ZLAB = '''
"""A stand-in for z-lab's package with its call shapes: greedy AR through the target's own generate()."""
import types


class DFlashDraftModel:
    mask_token_id, block_size = 256, 8
    config = types.SimpleNamespace(_attn_implementation="sdpa")

    @classmethod
    def from_pretrained(cls, path, **kwargs):
        return cls()

    def to(self, device):
        return self

    def eval(self):
        return self


def dflash_generate(draft, target, x, max_new_tokens, stop_token_ids, temperature=0.0, return_stats=False,
                    **kwargs):
    assert temperature == 0.0 and return_stats
    out = target.generate(x, max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=stop_token_ids)
    return types.SimpleNamespace(output_ids=out, acceptance_lengths=[1] * (out.shape[1] - x.shape[1]))
'''

FAKE_DDTREE = '''
from loguru import logger  # the DDTree code's module-level imports (stand-ins where not installed)
from datasets import load_dataset
from model import DFlashDraftModel
import dflash


def ddtree_generate(draft, target, x, mask_token_id, max_new_tokens, block_size, stop_token_ids, temperature,
                    tree_budget):
    assert (mask_token_id, block_size) == (256, 8) and tree_budget == 7
    logger.info("fake ddtree")
    return dflash.dflash_generate(draft, target, x, max_new_tokens, stop_token_ids, temperature=temperature,
                                  return_stats=True)
'''


def write_fake_references(root: Path) -> Path:
    """``root/zlab/dflash/`` and ``root/ddtree/`` laid out as the real sources are carried (gpu_check.sh's
    GPU_CHECK_REF_SRC): stand-ins with the references' call shapes."""
    zlab = root / "zlab" / "dflash"
    zlab.mkdir(parents=True)
    (zlab / "__init__.py").write_text("")
    (zlab / "model.py").write_text(FAKE_ZLAB)
    ddtree = root / "ddtree"
    (ddtree / "model").mkdir(parents=True)
    (ddtree / "model" / "__init__.py").write_text("from dflash import DFlashDraftModel\n")
    (ddtree / "dflash.py").write_text(FAKE_ZLAB)
    (ddtree / "ddtree.py").write_text(FAKE_DDTREE)
    return root


def test_references_from_source_directories(tmp_path, monkeypatch):
    """``--zlab-src`` (z-lab's package as files, run by this interpreter) and ``--ddtree-src``: both workers
    load from those directories (stand-ins with the references' call shapes), their rows, ratios, op counts and
    greedy tokens reach the report."""
    ddtree = write_fake_references(tmp_path) / "ddtree"
    out = tmp_path / "r.json"
    assert _run(["--dry-run", "--zlab-src", str(tmp_path / "zlab"), "--ddtree-src", str(ddtree),
                 "--json", str(out)], monkeypatch) == 0
    report = json.loads(out.read_text())
    rows = {r["name"]: r for r in report["rows"]}
    assert set(rows) == {"z-lab dflash_generate", "ours dflash, eager", "reference ddtree_generate",
                         "ours ddtree, eager"}, report["notes"]
    for name in ("z-lab dflash_generate", "reference ddtree_generate"):
        assert rows[name]["greedy_equal"] is True and rows[name]["tau"] == 1.0
        assert rows[name]["ops_per_round"] > 0
    assert rows["ours dflash, eager"]["ratio_to_reference"] > 0
    assert report["device"].startswith("CPU")


def test_a_zlab_source_directory_without_the_package_is_refused(tmp_path, monkeypatch, capsys):
    """Reported and our side still runs; with --require-references (gpu_check.sh's step) the exit status is 2."""
    out = tmp_path / "r.json"
    argv = ["--dry-run", "--methods", "dflash", "--no-ops", "--zlab-src", str(tmp_path), "--json", str(out)]
    assert _run(argv, monkeypatch) == 0
    notes = json.loads(out.read_text())["notes"]
    assert any("no z-lab package at --zlab-src" in n for n in notes), notes
    assert _run(argv + ["--require-references"], monkeypatch) == 2
    assert "--require-references: not run: z-lab dflash_generate" in capsys.readouterr().out


@pytest.mark.skipif(shutil.which("timeout") is None, reason="coreutils timeout is missing")
def test_gpu_check_refloops_step_dry_run(tmp_path):
    """``GPU_CHECK_DRY_RUN=1 GPU_CHECK_STEPS=refloops bash bench/gpu_check.sh`` with the sources under
    GPU_CHECK_REF_SRC: the step runs both references beside ours (on the CPU) and writes its JSON."""
    refs = write_fake_references(tmp_path / "refsrc")
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPU_CHECK_") and k not in ("OUT", "PYTHON")}
    env.update(GPU_CHECK_DRY_RUN="1", GPU_CHECK_STEPS="refloops", GPU_CHECK_REF_SRC=str(refs),
               PYTHON=sys.executable, OUT=str(tmp_path / "out"))
    result = subprocess.run(["bash", str(ROOT / "bench" / "gpu_check.sh")], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    report = json.loads((tmp_path / "out" / "reference_loops.json").read_text())
    assert {r["name"] for r in report["rows"]} >= {"z-lab dflash_generate", "reference ddtree_generate"}
    assert all(r["greedy_equal"] for r in report["rows"])
    summary = json.loads((tmp_path / "out" / "gpu_check_summary.json").read_text())
    assert {s["step"]: s["state"] for s in summary["steps"]}["refloops"] == "ok"


def test_an_unavailable_device_is_refused(monkeypatch, capsys):
    if torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    with pytest.raises(SystemExit):
        _run(["--dry-run", "--device", "cuda"], monkeypatch)
    assert "CUDA is not available" in capsys.readouterr().err
